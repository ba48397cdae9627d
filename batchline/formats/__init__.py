"""Input formats: the members of the FORMATS table (batchline.registry), one module each,
filling the format port (`batchline.snapshot.formats`)."""
