"""Errors a user of nostall can see. Each message names the bad value and what is accepted."""


class NostallError(Exception):
    """Base class of the errors nostall raises on purpose."""


class InvalidRequestError(NostallError, ValueError):
    """A request (prompt or sampling parameters) that cannot be served as given."""


class ModelLoadError(NostallError, ValueError):
    """A model path, file or configuration that cannot be loaded."""


class ConfigError(NostallError, ValueError):
    """An engine option that is out of range or inconsistent with the model."""
