"""Scheduling core of the Kiln runtime: requests, the KV cache block manager and the
scheduler.  Plain Python with no torch import, so it is testable in microseconds."""
