"""What one HTTP request carries between the middleware and the parsers.

`tool_parsers.middleware` opens a `RequestRecord` for each HTTP request and puts it in
a context variable. Everything vLLM runs for that request (the handler, the streaming
generator, vLLM's own request log) runs in a copy of that context, so:

* the parsers add what they found in the output (`report_findings`: the tool-call
  issues, with the ids of calls cut short) to the record's `ParserFindings`, and the
  response layer reads them there: it writes the issues into the response
  (`tool_call_issues`, see the README) and leaves calls cut short out of
  `/v1/messages`;
* the logging filter adds the HTTP receipt and end-of-body spans to vLLM's
  `Received request` log line.

Outside a request (parser-level tests, a server without the middleware) there is no
record and both are no-ops.

The middleware also marks requests whose answer must be JSON with `JSON_ANSWER_KWARG`
in `chat_template_kwargs`, the one per-request field that reaches every parser of the
request, the engine core's included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

ISSUES_FIELD = "tool_call_issues"
ISSUES_HEADER = b"x-tool-call-issues"
# A request flag in chat_template_kwargs, set by the middleware for requests whose answer
# must be JSON and that cannot call tools; the parsers read it (see tool_parsers.qwen38).
JSON_ANSWER_KWARG = "tool_parsers_json_answer"


@dataclass
class ParserFindings:
    """What the tool parsers found in one request's output: issues, and calls cut short."""

    _issues: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    _call_ids: dict[tuple[Any, ...], set[str]] = field(default_factory=dict)

    def add(self, issues: list[dict[str, Any]]) -> None:
        # vLLM may parse one output more than once (a second parser instance, a final
        # re-parse of a stream), each time with new call ids: an issue is the same issue
        # when these fields agree. The ids are kept to find the issue again.
        for issue in issues:
            key = tuple(issue.get(k) for k in ("issue", "index", "name", "argument"))
            self._issues.setdefault(key, {k: v for k, v in issue.items() if k != "id"})
            if issue.get("id"):
                self._call_ids.setdefault(key, set()).add(str(issue["id"]))

    def issues(self) -> list[dict[str, Any]]:
        return [dict(issue) for issue in self._issues.values()]

    def _cut_short_keys(self, call_id: str | None) -> list[tuple[Any, ...]]:
        return [
            key
            for key, issue in self._issues.items()
            if issue.get("issue") == "cut_short" and call_id is not None and call_id in self._call_ids.get(key, ())
        ]

    def is_cut_short(self, call_id: str | None) -> bool:
        """Whether the call with this id is one the end of the output cut short."""
        return bool(self._cut_short_keys(call_id))

    def mark_left_out(self, call_id: str) -> None:
        """The response layer left out the call with this id (a call cut short)."""
        for key in self._cut_short_keys(call_id):
            self._issues[key]["action"] = "dropped_call"


@dataclass
class RequestRecord:
    method: str
    path: str
    received: float = field(default_factory=time.monotonic)
    body_end: float | None = None
    response_start: float | None = None
    findings: ParserFindings = field(default_factory=ParserFindings)

    def spans(self, now: float | None = None) -> str:
        """`http_receipt_to_body_end=… body_end_to_now=…`, in milliseconds."""
        now = time.monotonic() if now is None else now
        body = "-" if self.body_end is None else f"{(self.body_end - self.received) * 1000:.1f}ms"
        since = "-" if self.body_end is None else f"{(now - self.body_end) * 1000:.1f}ms"
        return f"http_receipt_to_body_end={body} body_end_to_now={since}"


_CURRENT: ContextVar[RequestRecord | None] = ContextVar("tool_parsers_request", default=None)


def current_request() -> RequestRecord | None:
    return _CURRENT.get()


@contextmanager
def request_record(method: str, path: str) -> Iterator[RequestRecord]:
    """The record of the HTTP request being served: the current one, else a new one for this block."""
    record = _CURRENT.get()
    if record is not None:
        yield record
        return
    record = RequestRecord(method, path)
    token = _CURRENT.set(record)
    try:
        yield record
    finally:
        _CURRENT.reset(token)


def report_findings(issues: list[dict[str, Any]]) -> None:
    """Add a parser's issues (cut calls among them) to the current request's findings."""
    record = _CURRENT.get()
    if record is not None and issues:
        record.findings.add(issues)
