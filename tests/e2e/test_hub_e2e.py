"""examples/smollm2-hub.yaml on the test plane: the build Job downloads the model through a
Hub mirror (``kiln.devcluster.hubserver`` on loopback, which the plane's process-backed pods
reach) with the token from a Secret, builds, and the engine serves."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kiln.devcluster.hubserver import HubServer
from kiln.devcluster.load import chat

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-hub.yaml"
TOKEN = "hf_kilne2etoken"


def test_hub_model_builds_through_a_mirror_and_serves(stack, ns):
    from kiln.runtime import loader

    ie = yaml.safe_load(EXAMPLE.read_text())
    hf = ie["spec"]["model"]["huggingFace"]
    folder = loader.materialize_gguf(loader.resolve_source(None)).path
    with HubServer() as hub:
        hub.add(hf["repo"], folder, sha=hf["revision"], token=TOKEN)  # gated: the Secret's token opens it
        stack.kubectl("create", "secret", "generic", hf["secretRef"]["name"], "-n", ns,
                      f"--from-literal={hf['secretRef']['key']}={TOKEN}")
        obj = copy.deepcopy(ie)
        obj["spec"]["model"]["huggingFace"]["endpoint"] = hub.url
        # the example's fp8 calibration is covered by the other e2e builds; what this test is
        # about is the download, so its build does not quantize (minutes less on 2 cores)
        obj["spec"]["build"] = {"quantization": "none", "maxSeqLen": 2048}
        stack.apply_obj(obj, ns)
        name = ie["metadata"]["name"]
        stack.wait_ready(name, ns)
        st = stack.engine(name, ns)["status"]
        assert st["build"]["state"] == "Succeeded"
        assert hub.total_gets() > 0
        proxy = stack.proxy(name, ns)
        proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
        answer = chat(proxy.url, "What is the capital of France?", max_tokens=48,
                      model=ie["spec"]["model"]["servedModelName"])
        assert "paris" in answer.lower(), answer
        # the engine's manifest names the repo and commit; the download cache is on the claim
        h = st["engineHash"]
        dirs = list((stack.state_dir.parent / "volumes").glob(f"{ns}_kiln-engine-cache_*/{h}"))
        assert dirs, "no engine folder on the claim"
        manifest = yaml.safe_load((dirs[0] / "manifest.json").read_text())
        assert manifest["source"]["ref"] == f"hf://{hf['repo']}@{hf['revision']}"
        assert (dirs[0].parent / ".hf-cache").is_dir()
