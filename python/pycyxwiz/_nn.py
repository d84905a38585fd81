"""The model stack (issue 3): modules, Sequential model, losses, optimizers."""
__all__: list = []
