"""The routers of the second-wave MoE families against transformers' own, and DeepSeek-V3's
auxiliary-loss-free balancing: its update rule, a skewed router balanced by it, and the same
biases on every mesh."""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import models
from eqxzoo.nn import Router, balance_selection_bias
from eqxzoo.optim import OptimizerConfig
from eqxzoo.parallel import MeshConfig, Schedule, make_mesh
from eqxzoo.parallel.mesh import MeshError
from eqxzoo.parallel.pipeline import STAGE_SCOPE
from eqxzoo.run.config import model_config_for_mesh
from eqxzoo.train import step as step_module
from eqxzoo.train.layout import from_pipeline_layout
from eqxzoo.train.loss_terms import LossConfig
from eqxzoo.train.settings import StepConfig
from eqxzoo.train.state import abstract_train_state, init_train_state
from eqxzoo.train.step import (
    PlanWouldDeadlock,
    compile_train_step,
    compile_train_step_for,
    make_train_step,
)

D_MODEL, N_EXPERTS, TOKENS = 16, 8, 40


def torch_router_case(module_class, config_class, **fields):
    """A transformers router of random weights (and, where it has one, random balancing
    bias) and the zoo `Router` holding the same values."""
    torch.manual_seed(0)
    config = config_class(hidden_size=D_MODEL, num_attention_heads=4, **fields)
    hf_router = module_class(config).float()
    with torch.no_grad():
        for parameter in hf_router.parameters():
            parameter.normal_(0.0, 0.5)
        if hasattr(hf_router, "e_score_correction_bias"):
            hf_router.e_score_correction_bias.normal_(0.0, 0.1)
    return config, hf_router


def zoo_router(hf_router, *, top_k, **options) -> Router:
    router = Router(D_MODEL, N_EXPERTS, top_k, key=jax.random.key(0), **options)
    router = eqx.tree_at(lambda r: r.weight, router, jnp.asarray(hf_router.weight.detach().T))
    if router.bias is not None:
        router = eqx.tree_at(lambda r: r.bias, router, jnp.asarray(hf_router.bias.detach()))
    if router.selection_bias is not None:
        bias = jnp.asarray(hf_router.e_score_correction_bias.detach())
        router = eqx.tree_at(lambda r: r.selection_bias, router, bias)
    return router


def assert_same_routing(routing, hf_weights, hf_experts):
    """Same chosen experts per token (in any order) with the same weights."""
    order = np.argsort(np.asarray(routing.experts), axis=-1)
    hf_order = np.argsort(hf_experts, axis=-1)
    experts = np.take_along_axis(np.asarray(routing.experts), order, axis=-1)
    np.testing.assert_array_equal(experts, np.take_along_axis(hf_experts, hf_order, axis=-1))
    weights = np.take_along_axis(np.asarray(routing.weights), order, axis=-1)
    hf_sorted = np.take_along_axis(hf_weights, hf_order, axis=-1)
    np.testing.assert_allclose(weights, hf_sorted, rtol=1e-5, atol=1e-7)


def tokens() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(TOKENS, D_MODEL)).astype(np.float32)


def test_sigmoid_group_limited_router_matches_deepseek_v3():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    fields = dict(
        n_routed_experts=N_EXPERTS,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    _, hf_router = torch_router_case(
        v3.DeepseekV3TopkRouter, transformers.DeepseekV3Config, **fields
    )
    router = zoo_router(
        hf_router,
        top_k=3,
        normalize_topk=True,
        scoring="sigmoid",
        n_groups=4,
        topk_groups=2,
        scaling=2.5,
        selection_bias=True,
    )
    x = tokens()
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_router(torch.from_numpy(x))
    routing = router(jnp.asarray(x))
    assert_same_routing(routing, hf_weights.numpy(), hf_experts.numpy())
    np.testing.assert_allclose(np.sum(routing.probs, axis=-1), 1.0, rtol=1e-6)


def test_softmax_group_limited_router_matches_deepseek_v2():
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

    fields = dict(
        n_routed_experts=N_EXPERTS,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=3,
        topk_method="group_limited_greedy",
        routed_scaling_factor=16.0,
    )
    _, hf_router = torch_router_case(
        v2.DeepseekV2TopkRouter, transformers.DeepseekV2Config, **fields
    )
    router = zoo_router(
        hf_router, top_k=2, normalize_topk=False, n_groups=4, topk_groups=3, scaling=16.0
    )
    x = tokens()
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_router(torch.from_numpy(x))
    assert_same_routing(router(jnp.asarray(x)), hf_weights.numpy(), hf_experts.numpy())


def test_softmax_over_the_chosen_logits_matches_gpt_oss():
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    _, hf_router = torch_router_case(
        gpt_oss.GptOssTopKRouter,
        transformers.GptOssConfig,
        num_local_experts=N_EXPERTS,
        num_experts_per_tok=4,
    )
    router = zoo_router(hf_router, top_k=4, normalize_topk=False, scoring="softmax_topk", bias=True)
    x = tokens()
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_router(torch.from_numpy(x))
    assert_same_routing(router(jnp.asarray(x)), hf_weights.numpy(), hf_experts.numpy())


def test_groups_that_leave_too_few_experts_are_refused():
    with pytest.raises(ValueError, match="leave fewer than top_k=5 experts"):
        Router(D_MODEL, 8, 5, normalize_topk=True, n_groups=4, topk_groups=2, key=jax.random.key(0))
    with pytest.raises(models.ConfigError, match=r"^n_groups: must divide n_experts=8, got 3$"):
        models.MoEConfig(n_experts=8, n_groups=3)


def test_balancing_bias_update_follows_the_rule():
    rng = np.random.default_rng(0)
    load = rng.dirichlet(np.ones(N_EXPERTS), size=3).astype(np.float32)
    bias = rng.normal(size=(3, N_EXPERTS)).astype(np.float32)
    expected = bias + 0.01 * np.sign(load.mean(axis=-1, keepdims=True) - load)
    updated = balance_selection_bias(jnp.asarray(bias), jnp.asarray(load), 0.01)
    np.testing.assert_allclose(updated, expected, rtol=1e-6)
    balanced = balance_selection_bias(jnp.asarray(bias), jnp.full_like(load, 1 / N_EXPERTS), 0.5)
    np.testing.assert_array_equal(balanced, bias)


N_LAYERS = 4
SHAPE = (1, 2, 4, 8)  # (G, M, B, T)


def balanced_moe_config(tiny_config) -> models.DecoderConfig:
    config = tiny_config("mixtral", n_layers=N_LAYERS)
    moe = dataclasses.replace(config.moe, scoring="sigmoid", selection_bias=True)
    return dataclasses.replace(config, moe=moe)


ONE_STAGE = Schedule("gpipe", 1, SHAPE[1], 1)


def run_balancing(
    config, mesh_config, schedule, n_steps, random_batch, *, rate, skew=None
) -> tuple:
    """``(final state, per-step expert fractions (layers, experts))`` of ``n_steps`` steps;
    ``skew`` (one bias per expert) is set as every layer's selection bias first."""
    mesh = make_mesh(mesh_config, jax.devices()[: mesh_config.size])
    step_config = StepConfig(
        schedule=schedule,
        optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=0),
        loss=LossConfig(bias_update_rate=rate),
    )
    state = init_train_state(
        lambda key: models.DecoderLM(config, key=key),
        jax.random.key(0),
        config=step_config,
        mesh=mesh,
    )
    if skew is not None:

        def biases(s):
            return s.model.blocks.layers.mlp.router.selection_bias

        skewed = jnp.broadcast_to(jnp.asarray(skew, jnp.float32), biases(state).shape)
        state = eqx.tree_at(biases, state, jax.device_put(skewed, biases(state).sharding))
    step = make_train_step(step_config, mesh)
    loads = []
    for index in range(n_steps):
        state, metrics = step(state, random_batch(SHAPE, index))
        loads.append(np.asarray(metrics["expert_fraction"]))
    return state, loads


def test_a_skewed_router_becomes_balanced(tiny_config, random_batch):
    """Biases favouring experts 0 and 1 (by more than the tiny router's score spread) send
    them most choices; moved by the rule, they even the load out within a few steps, and
    without the rule (rate 0) the skew stays."""
    config = balanced_moe_config(tiny_config)
    skew = [0.03, 0.015, 0.0, 0.0]

    def imbalance(rate):
        """The largest layer's expert load over the mean load (1: balanced), per step."""
        _, loads = run_balancing(
            config, MeshConfig(), ONE_STAGE, 10, random_batch, rate=rate, skew=skew
        )
        return [float(np.max(load) * load.shape[-1]) for load in loads]

    balancing, frozen = imbalance(0.003), imbalance(0.0)
    assert balancing[0] > 1.7
    assert np.mean(balancing[-4:]) < 1.45, balancing
    assert np.mean(frozen[-4:]) > 1.6, frozen


def test_balancing_biases_are_equal_on_pp1_and_pp2(tiny_config, random_batch):
    """Each layer's bias follows its own load on one stage, on two (GPipe) and on two with
    the layers placed in a V (zb_v: stage 0 holds the first and the last layers)."""
    config = balanced_moe_config(tiny_config)
    one, _ = run_balancing(config, MeshConfig(dp=2), ONE_STAGE, 3, random_batch, rate=0.01)
    plain_one = from_pipeline_layout(one.model, ONE_STAGE)
    bias_one = plain_one.blocks.layers.mlp.router.selection_bias
    assert np.any(np.asarray(bias_one) != 0)
    for schedule in (Schedule("gpipe", 2, SHAPE[1], 1), Schedule("zb_v", 2, SHAPE[1], 2)):
        two, _ = run_balancing(config, MeshConfig(pp=2, ep=2), schedule, 3, random_batch, rate=0.01)
        plain_two = from_pipeline_layout(two.model, schedule)
        bias_two = plain_two.blocks.layers.mlp.router.selection_bias
        np.testing.assert_array_equal(bias_two, bias_one, err_msg=schedule.name)


def stand_in_permutes(hlo_text: str) -> list[str]:
    """The first instruction of the pipeline's stage branch (its `STAGE_SCOPE`), by its
    op_name, as `permutes_in_branches` names the permutes there."""
    return re.findall(rf'op_name="([^"]*{re.escape(STAGE_SCOPE)}/[^"]*)"', hlo_text)[:1]


def test_stages_compute_through_bubbles_where_xla_cpu_cannot_skip_them(
    tiny_config, tmp_path, monkeypatch
):
    """Where the partitioner puts collective-permutes inside the pipeline's stage branch,
    which XLA:CPU cannot run while another stage idles, the step is refused (one line naming
    the way out), and `compile_train_step_for` compiles the stages without the branch
    instead. It remembers the refusal: the same plan again compiles only the step without
    the branch, another plan (a larger batch) tries the branch first. Since the region is
    manual over dp (`eqxzoo.parallel.pipeline.auto_batch_axes`) no model of the zoo makes
    the partitioner do so (this DeepSeek-shaped model on dp2 x pp2 x ep2 did, moving
    weights between mesh axes): an instruction of the stage branch stands in for one."""
    config = tiny_config("deepseek_v3", n_layers=N_LAYERS)
    mesh = make_mesh(MeshConfig(dp=2, pp=2, ep=2))
    step_config = StepConfig(schedule=Schedule("gpipe", 2, SHAPE[1], 1))
    target = abstract_train_state(
        lambda key: models.DecoderLM(config, key=key), config=step_config, mesh=mesh
    )
    monkeypatch.setattr(step_module, "permutes_in_branches", stand_in_permutes)
    real_compile, refusals, tried = step_module.compile_train_step, [], []

    def compile_and_record(config, *args, **kwargs):
        tried.append(config.skip_bubbles)
        try:
            return real_compile(config, *args, **kwargs)
        except PlanWouldDeadlock as refused:
            refusals.append(str(refused))
            raise

    monkeypatch.setattr(step_module, "compile_train_step", compile_and_record)
    compiled, used = compile_train_step_for(step_config, mesh, target, SHAPE, verdicts=tmp_path)
    assert tried == [True, False]
    (refusal,) = refusals
    assert re.fullmatch(
        r"this plan would hang on XLA:CPU: the partitioner put \d+ collective-permute\(s\) "
        r"inside the pipeline's stage branch \(first: \S+\), where devices of "
        r"stages idling in a bubble never arrive; on CPU, choose a mesh with fewer of dp, tp "
        r"and ep above 1, pp = 1, or the gpipe or circular schedule \(which then compute "
        r"through their bubbles\)",
        refusal,
    )
    assert used == dataclasses.replace(step_config, skip_bubbles=False)
    assert compiled is not None
    assert len(list(tmp_path.iterdir())) == 1
    tried = []
    monkeypatch.setattr(
        step_module,
        "compile_train_step",
        lambda config, *args, **kwargs: tried.append(config.skip_bubbles) or compiled,
    )
    compile_train_step_for(step_config, mesh, target, SHAPE, verdicts=tmp_path)
    assert tried == [False]
    larger_batch = (*SHAPE[:2], 2 * SHAPE[2], SHAPE[3])
    compile_train_step_for(step_config, mesh, target, larger_batch, verdicts=tmp_path)
    assert tried == [False, True]


def test_a_run_picks_the_dropless_kernel_its_mesh_allows(tiny_config):
    """The slotted dropless kernel (faster on CPU) loops as often as the routing overflows:
    stages holding different layers would reach the collectives the partitioner puts in that
    loop different numbers of times (a hang on XLA:CPU). A model built as it is runs
    ``"auto"`` sorted; a run picks slotted on CPU unless its mesh splits stages over more
    axes; ``"slotted"`` on such a mesh is refused in one line before anything compiles."""
    config = tiny_config("mixtral", n_layers=N_LAYERS)
    assert (
        models.DecoderLM(config, key=jax.random.key(0)).blocks.layers.mlp.experts.dropless_kernel
        == "sorted"
    )

    def kernel_on(mesh_config, model=config):
        return model_config_for_mesh(model, mesh_config).moe.dropless_kernel

    assert kernel_on(MeshConfig(pp=2)) == kernel_on(MeshConfig(dp=2, ep=2)) == "slotted"
    split = MeshConfig(dp=2, pp=2, ep=2)
    assert kernel_on(split) == kernel_on(MeshConfig(cp=2)) == "sorted"
    slotted = dataclasses.replace(
        config, moe=dataclasses.replace(config.moe, dropless_kernel="slotted")
    )
    assert kernel_on(split, slotted) == "slotted"
    mesh = make_mesh(split)
    step_config = StepConfig(schedule=Schedule("gpipe", 2, SHAPE[1], 1))
    target = abstract_train_state(models.model_factory(slotted), config=step_config, mesh=mesh)
    with pytest.raises(MeshError) as refused:
        compile_train_step(step_config, mesh, target, SHAPE)
    assert str(refused.value) == (
        "mesh {'dp': 2, 'pp': 2, 'tp': 1, 'ep': 2, 'cp': 1} splits pipeline stages over more axes, "
        "which the slotted dropless experts cannot run: set model.moe.dropless_kernel = "
        "'sorted' (or 'auto')"
    )
