"""The router's replica choice on plain data (kiln.operator.router.balance) and its flags."""

from __future__ import annotations

import math
import random

import pytest

from kiln.operator.router.balance import LeastOutstanding, PrefixAffinity, RoundRobin, make_policy, prefix_key
from kiln.operator.router.config import parse_args

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(4)]


def test_prefix_affinity_sends_one_prefix_to_one_replica_and_spreads_many():
    p = PrefixAffinity(1.25)
    keys = [f"system prompt {i}: you are a helpful assistant" for i in range(400)]
    first = {k: p.choose(REPLICAS, {}, k) for k in keys}
    assert all(p.choose(REPLICAS, {}, k) == first[k] for k in keys)  # stable
    share = {r: sum(1 for v in first.values() if v == r) for r in REPLICAS}
    assert all(n > 400 / len(REPLICAS) / 3 for n in share.values()), share  # every replica gets a fair part


def test_prefix_affinity_respects_the_load_bound():
    rng = random.Random(7)
    p = PrefixAffinity(1.25)
    for _ in range(500):
        load = {r: rng.randrange(0, 12) for r in REPLICAS}
        key = f"k{rng.random()}"
        r = p.choose(REPLICAS, load, key)
        bound = math.ceil(1.25 * (sum(load.values()) + 1) / len(REPLICAS))
        assert load[r] + 1 <= bound
        unloaded = p.choose(REPLICAS, {}, key)
        if load[unloaded] + 1 <= bound:  # the key's own replica when it has room
            assert r == unloaded


def test_prefix_affinity_spills_to_the_same_next_replica():
    p = PrefixAffinity(1.25)
    home = p.choose(REPLICAS, {}, "shared")
    busy = {home: 10}
    spill = p.choose(REPLICAS, busy, "shared")
    assert spill != home and all(p.choose(REPLICAS, busy, "shared") == spill for _ in range(5))


def test_removing_a_replica_moves_only_its_keys():
    p = PrefixAffinity(1.25)
    keys = [f"prefix {i}" for i in range(300)]
    before = {k: p.choose(REPLICAS, {}, k) for k in keys}
    gone = REPLICAS[1]
    rest = [r for r in REPLICAS if r != gone]
    after = {k: p.choose(rest, {}, k) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != gone)
    assert any(before[k] == gone for k in keys)


def test_load_factor_must_exceed_one():
    with pytest.raises(ValueError, match="above 1"):
        PrefixAffinity(1.0)


def test_least_outstanding_and_round_robin():
    lo = LeastOutstanding()
    assert lo.choose(REPLICAS, {REPLICAS[0]: 3, REPLICAS[1]: 1, REPLICAS[2]: 2, REPLICAS[3]: 5}, "") == REPLICAS[1]
    assert {lo.choose(REPLICAS, {}, "") for _ in range(8)} == set(REPLICAS)  # ties rotate
    rr = RoundRobin()
    assert [rr.choose(REPLICAS, {}, "") for _ in range(8)] == REPLICAS * 2
    assert isinstance(make_policy("prefix", 1.5), PrefixAffinity)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_prefix_key_of_each_request_shape():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prefix_key(chat, 100) == "system: Be brief.\nuser: Hi"
    assert prefix_key(chat, 5) == "syste"
    assert prefix_key({"prompt": "abcdef"}, 3) == "abc"
    assert prefix_key({"prompt": ["first", "second"]}, 10) == "first"
    assert prefix_key({"prompt": [1, 2, 3]}, 10) == "1 2 3"
    assert prefix_key({"prompt": [[4, 5]]}, 10) == "4 5"
    assert prefix_key({"text_input": "v2 text"}, 100) == "v2 text"
    assert prefix_key({}, 10) == "" and prefix_key({"messages": "x"}, 10) == ""


def test_router_flags():
    cfg = parse_args(["--backend", "a=http://h1:8000,http://h2:8000/", "--backend", "b=http://h3:1",
                      "--policy", "least-outstanding", "--load-factor", "1.5", "-n", "x", "-n", "y"])
    assert cfg.backends == {"a": ("http://h1:8000", "http://h2:8000"), "b": ("http://h3:1",)}
    assert cfg.policy == "least-outstanding" and cfg.load_factor == 1.5 and cfg.namespaces == ("x", "y")
    assert parse_args(["-A", "-n", "x"]).namespaces == ()


@pytest.mark.parametrize("argv,needle", [
    (["--backend", "nourl"], "MODEL=URL"),
    (["--backend", "m=ftp://x"], "http://"),
    (["--load-factor", "1"], "above 1"),
    (["--hold-timeout-seconds", "0"], "positive"),
    (["--policy", "random"], "invalid choice"),
    (["--port", "99999"], "[1, 65535]"),
    (["--port", "http"], "not a port"),
    (["--log-level", "LOUD"], "not one of DEBUG"),
])
def test_bad_router_flags_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err
