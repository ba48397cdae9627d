"""Planning: the snapshot streamed once into shards, slices and per-record hashes."""
