"""The errors a request can get from the engine, each with the HTTP status that reports it."""


class ServeError(ValueError):
    """A request cannot be served as asked; `status` is the HTTP status that reports it."""

    status = 400
    kind = "invalid_request_error"


class CartridgeNotFound(ServeError):
    status = 404
    kind = "not_found_error"
