"""What a transformers model is, read from its config and module tree: the description the driver serves, inferred where nobody wrote one."""
