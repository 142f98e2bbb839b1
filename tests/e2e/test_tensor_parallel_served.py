"""A model across two GPUs end to end, on a role with four simulated 24 GiB GPUs joined in
NVLink pairs: placed on the tightest pair, each GPU charged and held by its own rank, switched
with two one-GPU models and back through the openai SDK, shown on each GPU's bar of the status
page; and the sizes that cannot run, refused as they are declared."""

from __future__ import annotations

import json

import httpx

from cluster import FOURTEEN, running
from spans import BIG, GPUS, ask, heads_model, ranks

GiB = 1 << 30


def test_a_two_gpu_model_switches_with_two_one_gpu_models_and_back() -> None:
    with running("tp", GPUS) as cluster:
        heads_model(cluster.root / "models" / "big30", 30 * GiB)
        cluster.deploy("big", model="big30", residency="deep", engine_config=BIG)
        pinned = [("one", "gpu0"), ("two", "gpu1")]
        for name, gpu in pinned:
            cluster.deploy(name, residency="deep", engine_config=FOURTEEN, devices=[{"id": gpu}])
        client = cluster.openai()

        ask(client, "big")
        status = cluster.status("big")
        assert status["instances"][0]["gpu"] == "gpu0+gpu1", "the NVLink pair, lowest first"
        assert status["gpus"] == ["gpu0", "gpu1"]
        assert status["placed"].startswith("local gpu0+gpu1: its start fits now, all nvlink")
        assert "not local gpu2+gpu3: its start fits now, all nvlink" in status["placed"]
        ready = {c["domain"]: c for c in status["charges"] if c["domain"].startswith("gpu")}
        assert sorted(ready) == ["gpu0", "gpu1"]
        assert {c["bytes"] for c in ready.values()} == {16 * GiB + 5 * GiB // 4}, "a rank each"
        assert {c["provenance"] for c in ready.values()} == {"declared"}
        held = ranks(cluster, "big")
        assert sorted(held) == ["gpu0", "gpu1"]
        assert set(held["gpu0"]).isdisjoint(held["gpu1"]), "one worker per GPU"
        listing = cluster.ok("list", "deployments")
        assert "gpu0+gpu1" in next(line for line in listing.splitlines() if line.startswith("big"))

        ask(client, "one")  # big parks on both GPUs to make room on gpu0
        assert cluster.state("big") == "parked"
        parked = {c["domain"]: c for c in cluster.status("big")["charges"]}
        assert parked["gpu0"]["phase"] == parked["gpu1"]["phase"] == "parked"
        ask(client, "two")  # gpu1 has room beside big's parked rank
        assert (cluster.state("one"), cluster.state("two")) == ("ready", "ready")

        ask(client, "big")  # a switch parks both one-GPU models, and big wakes across both
        assert (cluster.state("one"), cluster.state("two")) == ("parked", "parked")
        assert cluster.state("big") == "ready"
        woke = cluster.choices("big")
        assert any("switch: releasing" in c["reason"] for c in woke), woke[-3:]

        ask(client, "one")  # and back
        assert (cluster.state("big"), cluster.state("one")) == ("parked", "ready")

        admin = {"Authorization": f"Bearer {cluster.role.credentials()['admin_token']}"}
        page = httpx.get(f"http://{cluster.role.management}/", headers=admin, timeout=30)
        assert page.status_code == 200
        assert "big parked, 1 of gpu0+gpu1" in page.text
        assert "big parked, 2 of gpu0+gpu1" in page.text


def test_sizes_that_cannot_run_are_refused_as_they_are_declared() -> None:
    with running("tpno", "gpu0:24GiB,gpu1:24GiB") as cluster:
        heads_model(cluster.root / "models" / "odd", 4 * GiB, heads=28, kv=4)
        documents = {
            "three": {"engine_config": {"tensor_parallel": 3}},
            "four": {"engine_config": {"tensor_parallel": 4}},
        }
        answers = {}
        for name, fields in documents.items():
            path = cluster.root / f"{name}.yaml"
            path.write_text(json.dumps({"name": name, "engine": "vllm", "model": "odd", **fields}))
            answers[name] = cluster.cli("deploy", "model", "--file", str(path))
        three, four = answers["three"], answers["four"]
        assert three.returncode == 2, three.stderr
        assert "tensor_parallel_invalid" in three.stderr
        assert "3 does not divide 28; use 1 or 2 or 4" in three.stderr
        assert four.returncode == 5, four.stderr
        assert "not_enough_gpus" in four.stderr
        assert "it spans 4 GPUs and this host has 2 (gpu0, gpu1)" in four.stderr
        assert cluster.declared() == {}, "nothing was declared"


def test_an_sglang_model_across_two_gpus_parks_and_wakes_every_rank() -> None:
    with running("tpsg", "gpu0:24GiB,gpu1:24GiB") as cluster:
        heads_model(cluster.root / "models" / "big30", 30 * GiB)
        cluster.deploy("sg", engine="sglang", model="big30", residency="deep", engine_config=BIG)
        client = cluster.openai()
        ask(client, "sg")
        held = ranks(cluster, "sg")
        assert sorted(held) == ["gpu0", "gpu1"], "a scheduler process per GPU"
        cluster.ok("park", "deployment", "sg", "--wait")
        parked = {c["domain"]: c["phase"] for c in cluster.status("sg")["charges"]}
        assert (parked["gpu0"], parked["gpu1"]) == ("parked", "parked")
        (park,) = [reason for _, to, reason in cluster.transitions("sg") if to == "parked"]
        assert "parked charge" in park, "counted once its fullest GPU was within the charge"
        ask(client, "sg")  # a request wakes every rank
        assert cluster.state("sg") == "ready"
        assert sorted(ranks(cluster, "sg")) == ["gpu0", "gpu1"]
