"""`batchline drill`: hurt workers on purpose (`run`), then prove from the store that nothing broke (`checks`)."""
