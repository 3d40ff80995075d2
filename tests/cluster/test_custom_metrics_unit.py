"""The custom-metrics server's pure parts, without a cluster."""

from kiln.devcluster.custom_metrics import pod_value, quantity, target_of


def test_quantity_is_exact_to_a_thousandth():
    assert quantity(3) == "3"
    assert quantity(1.5) == "1500m"
    assert quantity(0.0004) == "0"
    assert quantity(0.2) == "200m"


def test_targets_normalize():
    assert target_of("web-abc") == {"resource": "pod", "name": "web-abc"}
    assert target_of("pod/web-abc") == {"resource": "pod", "name": "web-abc"}
    assert target_of({"app": "web"}) == {"resource": "pod", "selector": {"app": "web"}}
    assert target_of("app=web,tier==x") == {"resource": "pod", "selector": {"app": "web", "tier": "x"}}
    assert target_of("deployments/web") == {"resource": "deployment", "name": "web"}


def test_pod_value_prefers_the_most_specific_entry():
    entries = [{"target": {"resource": "pod", "name": "*"}, "value": 1.0},
               {"target": {"resource": "pod", "selector": {"app": "web"}}, "value": 2.0},
               {"target": {"resource": "pod", "name": "web-1"}, "value": 3.0}]
    assert pod_value(entries, "web-1", {"app": "web"}) == 3.0
    assert pod_value(entries, "web-2", {"app": "web"}) == 2.0
    assert pod_value(entries, "db-0", {"app": "db"}) == 1.0
    assert pod_value(entries[1:], "db-0", {"app": "db"}) is None
