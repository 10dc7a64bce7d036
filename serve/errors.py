"""Request errors raised at submit time (nothing else in the engine is touched)."""


class RequestError(ValueError):
    """A request the engine refuses; `status` is the HTTP status the server maps it to."""
    status = 400
    code = "invalid_request"


class UnknownAdapterError(RequestError):
    status = 404
    code = "model_not_found"


class PromptTooLongError(RequestError):
    code = "context_length_exceeded"


class AdapterInUseError(RequestError):
    status = 409
    code = "adapter_in_use"
