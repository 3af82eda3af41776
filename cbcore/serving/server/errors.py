"""`ProtocolError`: a request the server will not run, answered with OpenAI's error body."""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    """A request the server will not run: answered with OpenAI's error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status_code: int = 400,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid_value(message: str, param: str) -> ProtocolError:
    """A 400 for a field whose value the server cannot take (OpenAI's code `invalid_value`), naming the field."""
    return ProtocolError(message, param=param, code="invalid_value")
