"""The planner on mixture-of-experts models: expert-parallel and expert-tensor sizes searched (pruned by memory
first), `labkit plan --json` rows with ep and etp, the explanation of what expert parallelism bought, and tensor
groups within a GB200 NVL72 rack's NVLink domain."""
import json

import pytest
import yaml

from labkit.cli import main
from labkit.megatron.shape import Shape
from labkit.plan.explain import experts_bought
from labkit.plan.inputs import Constraints, planning_input
from labkit.plan.search import expert_sizes, search, splits, tensor_domain
from labkit.plan.views import ranked_table
from labkit.spec import SpecError, load_spec

H100_64 = {"nodes": [{"gpu": "H100", "count": 8, "gpus_per_node": 8}]}


@pytest.fixture(scope="module")
def mixtral_plan(tmp_path_factory):
    cluster = tmp_path_factory.mktemp("plan") / "h100.yaml"
    cluster.write_text(yaml.safe_dump(H100_64))
    base, constraints = planning_input(str(cluster), "mixtral-8x7b", 256)
    return base, constraints, search(base, top=10, constraints=constraints)


def test_the_planner_proposes_expert_parallelism_for_mixtral_on_64_h100(mixtral_plan):
    _, _, plan = mixtral_plan
    best = plan.best
    assert not best.oom and best.ep > 1 and best.etp == 1
    assert best.spec.parallel.expert == best.ep
    assert best.breakdown["ep_comm"] > 0
    # the chosen spec is one the rule book accepts
    load_spec(best.spec.to_dict())
    # the search stays small: memory prunes expert sizes, lower bounds the rest (counted, not timed: machines vary)
    assert plan.configs_pruned > plan.configs_evaluated


def test_plan_json_rows_carry_ep_and_etp(capsys, tmp_path):
    cluster = tmp_path / "h100.yaml"
    cluster.write_text(yaml.safe_dump(H100_64))
    assert main(["plan", str(cluster), "--model", "mixtral-8x7b", "--global-batch", "256", "--top", "5",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all({"tp", "pp", "dp", "cp", "ep", "etp"} <= set(r) for r in rows)
    assert any(r["ep"] > 1 for r in rows)
    keys = list(rows[0])
    assert keys.index("ep") == keys.index("cp") + 1 and keys.index("etp") == keys.index("ep") + 1
    for r in rows:
        assert r["tp"] * r["cp"] * r["dp"] % (r["ep"] * r["etp"]) == 0 and 8 % r["ep"] == 0
    # a dense model's rows: ep 1, etp the tensor size
    assert main(["plan", "a100-a10-hetero", "--model", "gpt2-xl", "--global-batch", "64", "--top", "3",
                 "--json"]) == 0
    for r in json.loads(capsys.readouterr().out)["rows"]:
        assert r["ep"] == 1 and r["etp"] == r["tp"]


def test_the_ranked_table_shows_expert_sizes_for_moe_models_only(mixtral_plan):
    _, _, plan = mixtral_plan
    table = ranked_table(plan, top=5)
    assert {"ep", "etp"} <= set(table.columns) and table["ep"].iloc[0] == plan.best.ep
    dense = search(load_spec({"model": {"preset": "gpt2-small"}, "batch": {"micro": 1, "global": 16},
                              "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1, "gpus_per_node": 4}]}}), top=3)
    assert "ep" not in ranked_table(dense).columns


def test_explain_says_what_expert_parallelism_bought(mixtral_plan):
    base, constraints, plan = mixtral_plan
    lines = experts_bought(plan.best)
    assert len(lines) == 1 and f"parallel.expert {plan.best.ep}" in lines[0]
    assert "GB saved" in lines[0] and "all-to-all" in lines[0]
    assert experts_bought(search(load_spec({"model": {"preset": "gpt2-small"}, "batch": {"micro": 1, "global": 8},
                                            "cluster": {"nodes": [{"gpu": "A100-40GB", "count": 1,
                                                                   "gpus_per_node": 2}]}}), top=1).best) == []


def test_expert_sizes_divide_the_experts_and_the_stage_and_are_pruned_by_memory():
    base, _ = planning_input("a100-a10-hetero", "mixtral-8x22b", 64)
    shape = Shape.of(base.model)
    every = expert_sizes(base, shape, 2, 1, 8, 1)
    assert sorted(every) == sorted([(1, 2)] + [(e, 1) for e in (2, 4, 8)] + [(e, 2) for e in (2, 4, 8)])
    # Mixtral 8x7B's 46.7 B parameters on 80 GB GPUs without ZeRO-3: the experts must split, the more the fewer
    # pipeline stages share the layers
    mixtral, _ = planning_input("a100-a10-hetero", "mixtral-8x7b", 64)
    small = Shape.of(mixtral.model)
    fits = {(p, d): expert_sizes(mixtral, small, 1, p, d, 1, memory_gb=80, flash=True) for p, d in
            ((1, 64), (2, 8), (4, 16))}
    assert fits == {(1, 64): [(8, 1)], (2, 8): [(4, 1), (8, 1)], (4, 16): [(2, 1), (4, 1), (8, 1)]}
    # a written size is kept
    assert expert_sizes(base, shape, 1, 1, 16, 1, Constraints(expert=4), memory_gb=80) == [(4, 1)]
    dense, _ = planning_input("a100-a10-hetero", "gpt2-xl", 64)
    assert expert_sizes(dense, Shape.of(dense.model), 4, 2, 8, 1) == [(1, 4)]


def test_a_spec_that_writes_the_expert_size_keeps_it(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "mixtral-8x7b"}, "parallel": {"expert": 4},
                                    "batch": {"micro": 1, "global": 256}, "cluster": H100_64}))
    base, constraints = planning_input(str(path))
    assert constraints.expert == 4
    plan = search(base, top=3, constraints=constraints)
    assert plan.rows and {r.ep for r in plan.rows} == {4}
    path.write_text(yaml.safe_dump({"model": {"preset": "mixtral-8x7b"}, "parallel": {"expert": 3},
                                    "batch": {"micro": 1, "global": 256}, "cluster": H100_64}))
    with pytest.raises(Exception, match="parallel.expert: 3 ranks cannot share"):
        planning_input(str(path))


def test_a_spec_with_the_flex_dispatcher_plans_layouts_with_expert_ranks_to_exchange_between(tmp_path):
    path = tmp_path / "spec.yaml"
    flex = {"preset": "qwen3-30b-a3b", "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep"}
    cluster = {"nodes": [{"gpu": "H100", "count": 2, "gpus_per_node": 8}]}
    path.write_text(yaml.safe_dump({"model": flex, "batch": {"global": 64}, "cluster": cluster}))
    base, constraints = planning_input(str(path))
    assert (base.model.moe_token_dispatcher_type, base.model.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    plan = search(base, top=20, constraints=constraints)
    assert plan.rows and all(r.ep * r.etp > 1 for r in plan.rows)
    # expert 1 leaves the experts split over the tensor ranks: those layouts are planned
    path.write_text(yaml.safe_dump({"model": flex, "parallel": {"expert": 1}, "batch": {"global": 64},
                                    "cluster": cluster}))
    base, constraints = planning_input(str(path))
    rows = search(base, top=20, constraints=constraints).rows
    assert rows and all(r.ep == 1 and r.etp == r.tp > 1 for r in rows)
    # one expert-tensor x expert rank the spec wrote itself is refused, naming the dispatcher, as on one GPU
    path.write_text(yaml.safe_dump({"model": flex, "parallel": {"expert": 1, "expert_tensor": 1},
                                    "batch": {"global": 64}, "cluster": cluster}))
    with pytest.raises(SpecError, match="model.moe_token_dispatcher_type: flex: megatron-core's flex dispatcher"):
        planning_input(str(path))
    path.write_text(yaml.safe_dump({"model": flex, "batch": {"global": 8},
                                    "cluster": {"nodes": [{"gpu": "H100", "count": 1, "gpus_per_node": 1}]}}))
    with pytest.raises(SpecError, match="keep one expert rank with alltoall or allgather"):
        planning_input(str(path))


def test_tensor_groups_may_span_the_trays_of_an_nvl72_rack():
    rack = load_spec({"model": {"preset": "mixtral-8x7b"}, "batch": {"micro": 1, "global": 576},
                      "cluster": {"nodes": [{"gpu": "GB200", "count": 18, "gpus_per_node": 4}]}})
    assert tensor_domain(rack.cluster) == 72
    assert 8 in {t for t, _, _, _ in splits(rack, 72, tensor_domain(rack.cluster))}
    h100 = load_spec({"model": {"preset": "mixtral-8x7b"}, "batch": {"micro": 1, "global": 256}, "cluster": H100_64})
    assert tensor_domain(h100.cluster) == 8
    # two trays of a rack: their domain is 8 GPUs
    trays = load_spec({"model": {"preset": "gpt2-small"}, "batch": {"micro": 1, "global": 8},
                       "cluster": {"nodes": [{"gpu": "GB200", "count": 2, "gpus_per_node": 4}]}})
    assert tensor_domain(trays.cluster) == 8


def test_memory_caps_of_a_pipeline_with_fewer_than_two_layers_per_stage():
    """Mixtral's 32 layers over 32 stages: the caps are read from one layer per stage, the model having no 64."""
    from labkit.catalog import clusters
    from labkit.plan.search import _Links, _memory_caps

    spec = load_spec({"model": {"preset": "mixtral-8x7b"}, "batch": {"micro": 1, "global": 64},
                      "parallel": {"pipeline": 32}, "recompute": {"granularity": "full", "num_layers": 1},
                      "cluster": {"nodes": clusters()["a100-a10-hetero"]["nodes"]}})
    caps = _memory_caps(spec, Shape.of(spec.model), _Links.of(spec), flash=True)
    assert len(caps) == 32 and caps[0] >= 1


def test_expert_parallel_rows_on_labkits_driver_shard_no_further_than_the_distributed_optimizer():
    """FSDP2, which runs ZeRO stages 2 and 3 on labkit's driver, keeps every expert on every rank: the driver refuses
    expert parallelism with it, so no such row is offered; Megatron-LM's Megatron-FSDP splits experts and keeps them."""
    from labkit.plan.search import search
    from labkit.spec import load_spec

    cluster = {"nodes": [{"gpu": "GB200", "count": 18, "gpus_per_node": 4}]}
    base = {"model": {"preset": "mixtral-8x7b"}, "batch": {"micro": 4, "global": 576}, "cluster": cluster}
    on_driver = search(load_spec(base), top=40).rows
    assert not [r for r in on_driver if r.ep > 1 and r.zero_stage >= 2]
    assert [r for r in on_driver if r.ep > 1] and [r for r in on_driver if r.zero_stage >= 2]
    megatron_lm = search(load_spec({**base, "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/m"}}),
                         top=40).rows
    assert [r for r in megatron_lm if r.ep > 1 and r.zero_stage >= 2]
