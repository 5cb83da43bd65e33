"""What one HTTP request carries between the middleware and the parsers.

`tool_parsers.middleware.RequestTimelineMiddleware` (the outermost ASGI layer) opens a
`RequestRecord` for each HTTP request and puts it in a context variable. Everything
vLLM runs for that request (the handler, the streaming generator, vLLM's own request
log) runs in a copy of that context, so:

* the parsers add the tool-call issues they find (`add_issues`), and the response
  layer writes them into the response (`tool_call_issues`, see the README);
* the logging filter adds the HTTP receipt and end-of-body spans to vLLM's
  `Received request` log line.

Outside a request (parser-level tests, a server without the middleware) there is no
record and both are no-ops.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

ISSUES_FIELD = "tool_call_issues"
ISSUES_HEADER = b"x-tool-call-issues"


@dataclass
class RequestRecord:
    method: str
    path: str
    received: float = field(default_factory=time.monotonic)
    body_end: float | None = None
    response_start: float | None = None
    _issues: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    _call_ids: dict[tuple[Any, ...], set[str]] = field(default_factory=dict)

    def add_issues(self, issues: list[dict[str, Any]]) -> None:
        # vLLM may parse one output more than once (a second parser instance, a final
        # re-parse of a stream), each time with new call ids: an issue is the same issue
        # when these fields agree. The ids are kept only to find the issue again.
        for issue in issues:
            key = tuple(issue.get(k) for k in ("issue", "index", "name", "argument"))
            self._issues.setdefault(key, {k: v for k, v in issue.items() if k != "id"})
            if issue.get("id"):
                self._call_ids.setdefault(key, set()).add(str(issue["id"]))

    def issues(self) -> list[dict[str, Any]]:
        return [dict(issue) for issue in self._issues.values()]

    def mark_dropped(self, call_id: str) -> None:
        """The response layer left out the call with this id (a call cut short)."""
        for key, issue in self._issues.items():
            if call_id in self._call_ids.get(key, ()) and issue.get("issue") == "cut_short":
                issue["action"] = "dropped_call"

    def spans(self, now: float | None = None) -> str:
        """`http_receipt_to_body_end=… body_end_to_now=…`, in milliseconds."""
        now = time.monotonic() if now is None else now
        body = "-" if self.body_end is None else f"{(self.body_end - self.received) * 1000:.1f}ms"
        since = "-" if self.body_end is None else f"{(now - self.body_end) * 1000:.1f}ms"
        return f"http_receipt_to_body_end={body} body_end_to_now={since}"


_CURRENT: ContextVar[RequestRecord | None] = ContextVar("tool_parsers_request", default=None)


def current_request() -> RequestRecord | None:
    return _CURRENT.get()


def open_request(method: str, path: str) -> tuple[RequestRecord, Any]:
    record = RequestRecord(method, path)
    return record, _CURRENT.set(record)


def close_request(token: Any) -> None:
    _CURRENT.reset(token)


def report_issues(issues: list[dict[str, Any]]) -> None:
    record = _CURRENT.get()
    if record is not None and issues:
        record.add_issues(issues)
