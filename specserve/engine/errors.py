"""The engine's own exceptions."""
from __future__ import annotations


class StepFailedError(RuntimeError):
    """The part of a step every scheduled request shares (the target forward) failed.

    ``request_ids`` are the requests of that step; requests not scheduled in it are untouched.
    """

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the engine step over {len(request_ids)} request(s) failed: {type(cause).__name__}: {cause}")
        self.request_ids = list(request_ids)
        self.cause = cause
