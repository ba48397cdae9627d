"""The gate's graders, each a member of `batchline.registry.GRADERS` in a module of its own,
owning its section of `validate`; `base` holds what they share."""
