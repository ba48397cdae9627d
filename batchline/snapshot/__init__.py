"""Input snapshots: records, the port of the formats they are read in, and the slices shards read.

The names other modules use are taken from here.
"""

from batchline.snapshot.reading import (
    PIECES_PER_SHARD,
    Piece,
    Record,
    ScannedRecord,
    Slice,
    StoredReader,
    content_hash,
    file_digest,
    input_pins,
    input_sources,
    parquet_slice_digest,
    pinned_snapshot,
    pinned_sources,
    read_slice,
    record_text,
    records_of,
    scan,
    scan_with_header,
    shared_columns,
    stored_input,
    text_hash,
)

__all__ = ["PIECES_PER_SHARD", "Piece", "Record", "ScannedRecord", "Slice", "StoredReader", "content_hash", "file_digest", "input_pins", "input_sources",
           "parquet_slice_digest", "pinned_snapshot", "pinned_sources", "read_slice", "record_text", "records_of", "scan",
           "scan_with_header", "shared_columns", "stored_input", "text_hash"]
