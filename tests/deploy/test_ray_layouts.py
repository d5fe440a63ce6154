"""The Ray deployment's files and builder without a cluster: every shipped Serve config passes
Serve's own schema and builds; the 2-node, 8-GPU layout places every replica on the node its
comment says, one GPU each; bad arguments name their field; the autoscaling policy's figures."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from services.ray_serve.app_config import parse_args

pytest.importorskip("ray.serve", reason="the Ray deployment needs pdserve[ray]")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "deploy" / "ray_serve").glob("*.yaml"))
TWO_NODES = ROOT / "deploy" / "ray_serve" / "two_node_8gpu.yaml"
DEPLOYMENTS = {"router", "prefill", "decode", "registry"}


def _built(config: dict, on_its_nodes: bool = False):
    """Serve's own build of the application (what `serve deploy` runs), with the config's
    `deployments:` options applied as Serve applies them. `on_its_nodes`: the model and targets
    folders it names are on its own (GPU) nodes, not here, so the node-local check is skipped."""
    from unittest import mock

    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.schema import ServeDeploySchema

    from services.ray_serve import app as app_module
    from services.ray_serve import build_app

    schema = ServeDeploySchema.model_validate(config)  # Serve's own check of the file
    (app,) = schema.applications
    with mock.patch.object(app_module, "check_paths", wraps=app_module.check_paths) as check:
        if on_its_nodes:
            check.side_effect = lambda _: None
        built = serve_build(build_app(app.args), name=app.name)
    assert check.call_count == 1
    overrides = {d.name: d.model_dump(exclude_unset=True) for d in app.deployments}
    deployments = {}
    for deployment in built.deployments:
        options = {
            "num_replicas": deployment.num_replicas,
            "ray_actor_options": deployment.ray_actor_options or {},
            "autoscaling_config": deployment._deployment_config.autoscaling_config,
        }
        options.update(overrides.get(deployment.name, {}))
        deployments[deployment.name] = options
    return app, deployments


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_serve_config_validates_and_builds(path):
    app, deployments = _built(yaml.safe_load(path.read_text()), on_its_nodes=path == TWO_NODES)
    assert app.import_path == "services.ray_serve:build_app"
    assert set(deployments) == DEPLOYMENTS
    for name in ("prefill", "decode"):
        options = deployments[name]["ray_actor_options"]
        assert "num_cpus" in options and "num_gpus" in options, (path.name, name)
        scaling = deployments[name].get("autoscaling_config")
        if scaling:  # requests bypass Serve's handles: only the engine-load policy sees them
            policy = scaling["policy"] if isinstance(scaling, dict) else scaling.policy
            function = (
                policy["policy_function"] if isinstance(policy, dict) else policy.policy_function
            )
            assert function == "services.ray_serve.autoscaling:engine_load_policy"


def _nodes(path: Path) -> dict[str, dict[str, float]]:
    """The nodes the layout's `ray start` comment lines create: name -> resources."""
    nodes = {}
    for line in path.read_text().splitlines():
        match = re.match(r"#\s+(node\w+)\$ ray start (.*)", line)
        if not match:
            continue
        args = dict(arg.split("=", 1) for arg in shlex.split(match.group(2)) if "=" in arg)
        resources = {"CPU": float(args["--num-cpus"]), "GPU": float(args["--num-gpus"])}
        resources.update(json.loads(args.get("--resources", "{}")))
        if "--head" in match.group(2):
            resources["node:__internal_head__"] = 1.0
        nodes[match.group(1)] = resources
    return nodes


def _place(nodes: dict[str, dict[str, float]], deployments: dict) -> dict[str, list[str]]:
    """First-fit placement of every replica on the nodes (as Ray's scheduler might: any fit
    will do for a check that everything fits and each pool lands where it may)."""
    free = {n: dict(r) for n, r in nodes.items()}
    placed: dict[str, list[str]] = {}
    for name in ("router", "registry", "prefill", "decode"):
        options = deployments[name]
        actor = options["ray_actor_options"]
        need = {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus", 0)}
        need.update(actor.get("resources", {}))
        for _ in range(options["num_replicas"]):
            node = next(
                (n for n, f in free.items() if all(f.get(k, 0) >= v for k, v in need.items())),
                None,
            )
            assert node is not None, f"a {name} replica fits on no node: {free}"
            for key, value in need.items():
                free[node][key] -= value
            placed.setdefault(name, []).append(node)
    return placed


def test_the_two_node_eight_gpu_layout_places_each_pool_where_its_comment_says():
    config = yaml.safe_load(TWO_NODES.read_text())
    app, deployments = _built(config, on_its_nodes=True)
    nodes = _nodes(TWO_NODES)
    assert sorted(nodes) == ["nodeA", "nodeB"] and sum(r["GPU"] for r in nodes.values()) == 8
    placed = _place(nodes, deployments)
    assert placed["router"] == ["nodeA"] and placed["registry"] == ["nodeA"]
    assert placed["prefill"] == ["nodeA"] * 2
    assert sorted(placed["decode"]) == ["nodeA"] * 2 + ["nodeB"] * 4  # P:D = 2:6
    for pool in ("prefill", "decode"):
        assert deployments[pool]["ray_actor_options"]["num_gpus"] == 1  # one GPU per replica
    parsed = parse_args(app.args)
    assert parsed.cluster.engine.device == "cuda"
    assert parsed.cluster.index.redis_url.startswith("redis://10.0.0.1:")  # Redis on node A
    assert parsed.prefill is not None and parsed.prefill.pin_cpus and parsed.decode.pin_cpus


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"prefill_config": {"worker": {"threads": 0}}}, "prefill_config.worker.threads:"),
        ({"decode_config": {"worker": {"host": "10.0.0.9"}}}, "decode_config.worker.host:"),
        ({"router_config": {"router": {"port": -1}}}, "router_config.router.port:"),
        ({"engine": {"block_size": "16"}}, "engine.block_size:"),
        ({"prefill_config": {"replicas": 2}}, "prefill_config.replicas: not a field"),
        ({"decoder_config": {}}, "decoder_config: not an argument"),
        ({"registry_config": {"ttl": 0}}, "registry_config.ttl:"),
        ({"decode_config": {"pin_cpus": "yes"}}, "decode_config.pin_cpus:"),
        ({"prefill_config": None}, "num_prefill:"),  # no prefill pool needs disaggregation never
    ],
)
def test_bad_app_arguments_name_their_field(args, message):
    with pytest.raises(ValueError) as error:
        parse_args(args)
    assert str(error.value).startswith(message), str(error.value)


def test_no_prefill_pool_with_colocated_serving_builds_without_a_prefill_deployment():
    from ray.serve._private.build_app import build_app as serve_build

    from services.ray_serve import build_app

    args = {"prefill_config": None, "router_config": {"router": {"disaggregation": "never"}}}
    built = serve_build(build_app(args), name="pdserve")
    assert {d.name for d in built.deployments} == DEPLOYMENTS - {"prefill"}


def test_a_worker_autoscaling_config_without_a_policy_gets_the_engine_load_policy():
    from services.ray_serve.app import options
    from services.ray_serve.autoscaling import POLICY

    spec = parse_args(
        {"decode_config": {"deployment_config": {"autoscaling_config": {"max_replicas": 4}}}}
    ).decode
    assert options(spec, worker=True)["autoscaling_config"] == {
        "max_replicas": 4,
        "policy": {"policy_function": POLICY},
    }
    assert "policy" not in options(spec)["autoscaling_config"]  # the router's stays Serve's


def test_engine_load_policy_asks_for_the_load_over_the_target():
    from services.ray_serve.autoscaling import engine_load_policy

    def ctx(per_replica: dict, current: int = 2, target: int = 3):
        config = SimpleNamespace(get_target_ongoing_requests=lambda: 8)
        return SimpleNamespace(
            aggregated_metrics={"num_requests": per_replica} if per_replica is not None else {},
            current_num_replicas=current,
            target_num_replicas=target,
            config=config,
        )

    assert engine_load_policy(ctx({"a": 20.0, "b": 12.0}))[0] == 4.0  # 32 requests / 8 each
    assert engine_load_policy(ctx({"a": 2.0, "b": 2.0}))[0] == 0.5  # Serve rounds and bounds it
    assert engine_load_policy(ctx({}))[0] == 3  # nothing reported yet: keep the target
    assert engine_load_policy(ctx({"a": 5.0}, current=0))[0] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"engine": {"model": "no-such-model"}}, "engine.model: 'no-such-model' is neither"),
        ({"prometheus_targets": "/no/such/folder/ray.json"}, "prometheus_targets: /no/such"),
    ],
)
def test_what_only_the_building_node_can_check_refuses_the_deploy(args, message):
    """Checked by build_app, so `serve deploy` is refused and the running version keeps serving
    (found in a replica's constructor, it would take the application down)."""
    from services.ray_serve import build_app

    with pytest.raises(ValueError) as error:
        build_app(args)
    assert str(error.value).startswith(message), str(error.value)


def test_a_relative_targets_path_is_refused():
    with pytest.raises(ValueError, match="^prometheus_targets: must be an absolute path"):
        parse_args({"prometheus_targets": "deploy/prometheus/targets/ray.json"})
