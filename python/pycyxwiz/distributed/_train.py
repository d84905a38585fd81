"""Data-parallel training (issue 4)."""
__all__: list = []
