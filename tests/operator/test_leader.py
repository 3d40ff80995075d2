"""Lease election: two candidates never both lead; an expired or released lease is taken over."""

import datetime as dt

from kiln.operator.leader import LeaderElector, LeaseConfig

from fakekube import FakeKube


def elector(kube, ident, **kw):
    return LeaderElector(kube, LeaseConfig(namespace="kiln-system", identity=ident, **kw))


def test_only_one_candidate_wins():
    kube = FakeKube()
    a, b = elector(kube, "a"), elector(kube, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.try_acquire_or_renew()  # renew
    assert not b.try_acquire_or_renew()


def test_expired_lease_is_taken_over_and_released_lease_at_once():
    kube = FakeKube()
    a, b = elector(kube, "a"), elector(kube, "b")
    assert a.try_acquire_or_renew()
    lease = kube.objects[("coordination.k8s.io/v1", "Lease", "kiln-system", "kiln-operator")]
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=60)
    lease["spec"]["renewTime"] = old.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert b.try_acquire_or_renew()
    assert not a.try_acquire_or_renew()
    assert lease is not kube.objects[("coordination.k8s.io/v1", "Lease", "kiln-system", "kiln-operator")]
    b.is_leader = True
    b.release()
    assert a.try_acquire_or_renew()


def test_stale_resource_version_loses_the_race():
    kube = FakeKube()
    a = elector(kube, "a")
    assert a.try_acquire_or_renew()
    cur = kube.get("coordination.k8s.io/v1", "Lease", "kiln-system", "kiln-operator")
    kube.replace(cur)  # someone else wrote in between
    from kiln.operator.kube import ApiError
    try:
        kube.replace(cur)
        raise AssertionError("CAS must fail")
    except ApiError as e:
        assert e.status == 409
