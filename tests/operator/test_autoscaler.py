"""The builtin autoscaler: histogram parsing, HPA's rule, stabilization windows."""

from kiln.operator.autoscaler import (BuiltinAutoscaler, HistogramTotals, mean_over_interval, parse_histogram,
                                      recommend, stabilize)
from kiln.operator.spec import AutoscalingSpec

TEXT = """# HELP kiln_request_queue_time_seconds Queue time
# TYPE kiln_request_queue_time_seconds histogram
kiln_request_queue_time_seconds_bucket{le="0.1"} 3.0
kiln_request_queue_time_seconds_bucket{le="+Inf"} 10.0
kiln_request_queue_time_seconds_sum 12.5
kiln_request_queue_time_seconds_count 10.0
kiln_time_to_first_token_seconds_sum 99
"""


def metrics(s, n):
    return f"kiln_request_queue_time_seconds_sum {s}\nkiln_request_queue_time_seconds_count {n}\n"


def test_parse_histogram():
    assert parse_histogram(TEXT) == HistogramTotals(12.5, 10.0)
    assert parse_histogram("other_metric 1\n") is None


def test_mean_over_interval():
    assert mean_over_interval(None, HistogramTotals(1, 1)) is None
    assert mean_over_interval(HistogramTotals(1, 2), HistogramTotals(5, 4)) == 2.0
    assert mean_over_interval(HistogramTotals(1, 2), HistogramTotals(1, 2)) == 0.0
    assert mean_over_interval(HistogramTotals(5, 5), HistogramTotals(1, 1)) is None  # counter reset


def test_recommend_follows_the_hpa_rule():
    assert recommend(2, 1.0, 0.5, 1, 10) == 4
    assert recommend(2, 0.52, 0.5, 1, 10) == 2  # within tolerance
    assert recommend(4, 0.0, 0.5, 1, 10) == 1
    assert recommend(3, 100.0, 0.5, 1, 5) == 5
    assert recommend(0, 1.0, 0.5, 2, 5) == 2


def test_stabilization_windows():
    hist = [(0, 5), (10, 2), (20, 1)]
    assert stabilize(hist, 3, 20, up_window=0, down_window=30) == 3  # max of window is 5 -> hold at 3
    assert stabilize(hist, 3, 35, up_window=0, down_window=30) == 2  # (10, 2), (20, 1) in window -> 2
    assert stabilize([(0, 1), (5, 6)], 2, 5, up_window=10, down_window=0) == 2  # lowest in up window is 1
    assert stabilize([(0, 1), (5, 6)], 2, 15, up_window=5, down_window=0) == 6


def test_builtin_autoscaler_scales_up_then_down():
    state = {"s": 0.0, "n": 0.0, "step": (10.0, 5.0)}

    def fetch(pod):
        ds, dn = state["step"]
        state["s"] += ds
        state["n"] += dn
        return metrics(state["s"], state["n"])

    t = [0.0]
    a = BuiltinAutoscaler(fetcher=fetch, clock=lambda: t[0])
    scaling = AutoscalingSpec(min_replicas=1, max_replicas=4, target_queue_time_seconds=0.5,
                              scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=10)
    pod = {"metadata": {"name": "p"}}
    assert not a.observe("ns/x", [pod], 1, scaling, "now")  # first scrape: no interval yet
    t[0] = 1
    assert a.observe("ns/x", [pod], 1, scaling, "now")  # mean 2 s vs 0.5 target
    want, status, active = a.wish("ns/x")
    assert active == "now"  # requests were scheduled in that interval (the idle window's clock)
    assert want == 4 and status["observedQueueTimeSeconds"] == 2.0 and status["desiredReplicas"] == 4
    state["step"] = (0.0, 5.0)  # no more queueing
    t[0] = 2
    a.observe("ns/x", [pod], 4, scaling, "now")
    assert a.wish("ns/x")[0] == 4  # held by the 10 s down window
    t[0] = 13
    a.observe("ns/x", [pod], 4, scaling, "now")
    assert a.wish("ns/x")[0] == 1
    a.forget("ns/x")
    assert a.wish("ns/x") == (None, None, None)


def test_an_interval_with_none_scheduled_but_requests_waiting_is_no_reading():
    """Long requests on few slots: a scrape interval may schedule no request while others wait.
    That is no queue-time reading (the recommendation holds), not a queue time of 0 (which
    would scale down a pod still starting under load); with nothing waiting it reads 0."""
    state = {"text": metrics(10.0, 5.0)}
    t = [0.0]
    a = BuiltinAutoscaler(fetcher=lambda pod: state["text"], clock=lambda: t[0])
    scaling = AutoscalingSpec(min_replicas=1, max_replicas=4, target_queue_time_seconds=0.5,
                              scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=0)
    pod = {"metadata": {"name": "p"}}
    a.observe("ns/x", [pod], 1, scaling, "now")
    t[0] = 1
    state["text"] = metrics(20.0, 10.0)  # 5 requests scheduled, 2 s mean queue time
    a.observe("ns/x", [pod], 1, scaling, "now")
    assert a.wish("ns/x")[0] == 4
    t[0] = 2
    state["text"] = metrics(20.0, 10.0) + 'kiln_num_requests_waiting{model_name="m"} 6\n'  # none scheduled, 6 waiting
    assert not a.observe("ns/x", [pod], 4, scaling, "now")
    assert a.wish("ns/x")[0] == 4
    t[0] = 3
    state["text"] = metrics(20.0, 10.0) + 'kiln_num_requests_waiting{model_name="m"} 0\n'  # idle: reads 0
    a.observe("ns/x", [pod], 4, scaling, "now")
    assert a.wish("ns/x")[0] == 1


def test_unreachable_pods_are_skipped():
    def fetch(pod):
        raise OSError("connection refused")

    a = BuiltinAutoscaler(fetcher=fetch)
    assert not a.observe("k", [{"metadata": {"name": "p"}}], 1,
                         AutoscalingSpec(min_replicas=1, max_replicas=2, target_queue_time_seconds=1,
                                         scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=0),
                         "now")


def test_out_of_cluster_fetcher_scrapes_only_loopback_pods():
    import pytest

    from kiln.operator.autoscaler import http_fetcher

    fetch = http_fetcher(timeout=0.2, loopback_only=True)
    with pytest.raises(LookupError, match="not reachable"):
        fetch({"status": {"podIP": "10.244.0.7"}})  # never contacted
    with pytest.raises(LookupError):
        fetch({"status": {}})
    try:  # loopback is tried (a local `kiln serve` may even answer)
        fetch({"status": {"podIP": "127.0.0.1"}})
    except OSError:
        pass
