"""The HTML report of a version: read from the store (`data`), drawn (`charts`), laid out (`page`)."""
