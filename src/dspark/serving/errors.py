"""OpenAI-style errors: every failure the server reports leaves as `{"error": {message, type, param, code}}`
with an HTTP status that says whose fault it was (4xx: the request's, 5xx: ours)."""
from __future__ import annotations

import json
import re

from starlette.responses import Response

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


class ClientGone(Exception):
    """The client disconnected before we could answer."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")


def from_pydantic(exc) -> APIError:
    """The first validation problem, named by its dotted location, as a 400 (not FastAPI's 422)."""
    err = exc.errors()[0]
    # a union's member ("prompt.list[int]") is pydantic's detail, not the client's parameter
    param = ".".join(str(p) for p in err.get("loc", ()) if not _UNION_MEMBER.match(str(p))) or None
    message = err.get("msg", "invalid request")
    if err.get("type") == "missing":
        message = f"'{param}' is a required property"
    elif err.get("type") == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    else:
        message = f"invalid value for '{param}': {message}" if param else message
    return APIError(400, message, param, "invalid_value" if err.get("type") != "missing" else "missing_required")
