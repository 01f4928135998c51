"""The error every family's HF config conversion raises."""


class UnsupportedConfigError(ValueError):
  """A HF config describes a model this decoder family cannot represent."""
