"""Cost-model arithmetic against hand-computed values: parameters (dense, GQA, MoE, hybrid), bytes,
FLOPs, step times, ceilings, plausible(), and gap accounting."""

from __future__ import annotations

import math

import pytest

from costmodel.ceiling import ceiling, plausible
from costmodel.deployment import CostDeployment, demo_dir
from costmodel.entry import MethodEntry, read_entry
from costmodel.gaps import GapError, check_accounting, measured_gaps, modelled_gaps
from costmodel.hardware import HardwareProfile
from costmodel.model_profile import ModelProfileError, from_config, load_model_profile
from costmodel.step import Drafter, StepError, draft_time, forward_time, sd_step

# A hand-made GQA Llama: hidden 64, 2 layers, 4 heads / 2 KV heads of 16, MLP 128, vocab 100, untied.
TOY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
       "tie_word_embeddings": False}
# embedding 6400 + lm_head 6400 + attention 2 * (q 4096 + k 2048 + v 2048 + o 4096)
# + MLP 2 * 3 * 64 * 128 + norms (2 * 2 * 64 + 64)
TOY_PARAMS = 6400 + 6400 + 2 * 12288 + 2 * 24576 + 320  # 86848

# A hand-made Qwen3-MoE: layer 0 routes 2 of 8 experts (MLP 24), layer 1 is dense (MLP 48); tied.
TOY_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 48, "vocab_size": 50,
           "tie_word_embeddings": True, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
           "decoder_sparse_step": 1, "mlp_only_layers": [1]}
# embedding 1600 + attention 2 * (1024 + 512 + 512 + 1024 + q/k norms 32) + router 256
# + experts 8 * 2304 + dense MLP 4608 + norms 160
TOY_MOE_TOTAL = 1600 + 6208 + 256 + 18432 + 4608 + 160  # 31264
TOY_MOE_ACTIVE = TOY_MOE_TOTAL - 18432 + 2 * 2304  # 17440

# 1 GB/s and 1 GFLOP/s: every byte costs 1e-6 ms and every FLOP 1e-6 ms, easy to do by hand.
SLOW = HardwareProfile("toy", mem_bandwidth_GBps=1.0, bf16_tflops=0.001, fp8_tflops=None, l2_MB=0.0)
# Same bandwidth, effectively infinite compute: memory-bound everywhere.
MEMBOUND = HardwareProfile("toy-mem", mem_bandwidth_GBps=1.0, bf16_tflops=1e9, fp8_tflops=None, l2_MB=0.0)


def toy() -> object:
    return from_config(dict(TOY), "toy")


# -- model profiles ------------------------------------------------------------------------------


def test_dense_gqa_params_kv_and_flops_by_hand():
    m = toy()
    assert m.total_params == TOY_PARAMS == 86848
    assert m.active_params == TOY_PARAMS
    # K and V, 2 layers, 2 KV heads (not 4 query heads), head_dim 16, 2 bytes.
    assert m.kv_bytes_per_token(2.0) == 2 * 2 * 2 * 16 * 2 == 256
    assert m.kv_bytes_per_token(1.0) == 128
    # 2 per matmul parameter (all but the input embedding) + 4 * context * layers * heads * head_dim.
    assert m.flops_per_token(10) == 2 * (TOY_PARAMS - 6400) + 4 * 10 * 2 * 4 * 16 == 166016
    assert m.recurrent_state_bytes() == 0


def test_weight_bytes_by_format():
    m = toy()
    # One token reads every matrix once and one row of the untied embedding.
    params = TOY_PARAMS - 6400 + 64
    assert m.weight_bytes("bf16", 1) == params * 2
    assert m.weight_bytes("fp32", 1) == params * 4
    assert m.weight_bytes("w12", 1) == params * 1.5
    assert m.weight_bytes("int8", 1) == params * 1
    with pytest.raises(ModelProfileError, match="w4"):
        m.weight_bytes("w4", 1)


def test_moe_total_and_active_params_by_hand():
    m = from_config(dict(TOY_MOE), "toy-moe")
    assert m.moe_layers == (True, False)
    assert m.total_params == TOY_MOE_TOTAL == 31264
    assert m.active_params == TOY_MOE_ACTIVE == 17440
    assert m.kv_bytes_per_token(2.0) == 2 * 2 * 1 * 16 * 2 == 128
    # One token reads what it activates; two tokens touch 8 * (1 - (6/8)^2) = 3.5 experts on average.
    assert m.weight_params_read(1) == pytest.approx(TOY_MOE_ACTIVE)
    assert m.experts_touched(2) == pytest.approx(3.5)
    assert m.weight_params_read(2) == pytest.approx(TOY_MOE_TOTAL - 18432 + 3.5 * 2304)
    assert m.experts_touched(10_000) == pytest.approx(8)


def test_hybrid_recurrent_state_and_layer_pattern():
    cfg = {"model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": 50,
           "full_attention_interval": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
           "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
           "shared_expert_intermediate_size": 8}
    m = from_config(cfg, "toy-next")
    assert m.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    # Only the one full-attention layer has a KV cache.
    assert m.kv_bytes_per_token(2.0) == 2 * 1 * 1 * 16 * 2
    # Per linear layer: delta state 4 heads * 8 * 8 fp32 + conv window (2*16 + 32 channels) * 3 bf16.
    assert m.recurrent_state_bytes() == 3 * (4 * 8 * 8 * 4 + 64 * 3 * 2) == 4224


def test_published_models():
    q8 = load_model_profile("qwen3-8b")
    assert q8.total_params == 8_190_735_360  # "8.2B" on the model card
    assert q8.kv_bytes_per_token(2.0) == 36 * 2 * 8 * 128 * 2  # 144 KiB
    assert load_model_profile("llama-3.1-8b").total_params == 8_030_261_248
    moe = load_model_profile("qwen3-30b-a3b")
    assert moe.total_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert moe.active_params / 1e9 == pytest.approx(3.35, abs=0.02)  # "A3B": 3.3B activated
    nxt = load_model_profile("qwen3-next-80b-a3b")
    # Counted independently by a third party from the same architecture (Qwen3-Coder-Next test suite).
    assert nxt.total_params == 79_674_391_296
    assert nxt.active_params == 3_874_929_408
    assert (nxt.num_attention_layers, nxt.num_linear_layers) == (12, 36)
    assert nxt.kv_bytes_per_token(2.0) == 12 * 2 * 256 * 2 * 2


def test_truncated_drafter_and_bad_configs(tmp_path):
    five = load_model_profile("qwen3-8b", num_layers=5)
    assert five.num_layers == 5
    assert five.total_params == 8_190_735_360 - 31 * 192_946_432  # 31 fewer decoder layers
    with pytest.raises(ModelProfileError, match="drafter-layers 99"):
        load_model_profile("qwen3-8b", num_layers=99)
    with pytest.raises(ModelProfileError, match="gpt2"):
        from_config({"model_type": "gpt2", "hidden_size": 8})
    with pytest.raises(ModelProfileError, match="not a shipped config"):
        load_model_profile(tmp_path / "nope")
    bad = tmp_path / "config.json"
    bad.write_text("{")
    with pytest.raises(ModelProfileError, match="not valid JSON"):
        load_model_profile(tmp_path)


def test_demo_target_profile():
    path = demo_dir() / "target" / "config.json"
    if not path.exists():
        pytest.skip("demo target not trained yet")
    m = load_model_profile(path.parent)
    assert m.model_type == "llama" and m.num_kv_heads < m.num_heads  # GQA
    assert 5e6 < m.total_params < 30e6


# -- step times ----------------------------------------------------------------------------------


def test_forward_time_by_hand():
    st = forward_time(SLOW, toy(), q=1, batch=1, context=10)
    # Bytes: weights 80512 params * 2; KV (10 + 1) * 256. FLOPs: one token at mean context 11.
    assert st.weight_bytes == 161024
    assert st.kv_bytes == 2816
    assert st.weights_ms == pytest.approx(0.161024)
    assert st.kv_ms == pytest.approx(0.002816)
    assert st.flops == 2 * 80448 + 4 * 11 * 2 * 4 * 16 == 166528
    assert st.compute_ms == pytest.approx(0.166528)
    assert st.bound == "compute"
    assert st.total_ms == pytest.approx(0.166528)


def test_forward_time_batch_shares_weights_not_kv():
    one = forward_time(MEMBOUND, toy(), q=4, batch=1, context=100)
    eight = forward_time(MEMBOUND, toy(), q=4, batch=8, context=100)
    assert eight.kv_bytes == 8 * one.kv_bytes == 8 * 104 * 256
    assert eight.weight_bytes == one.weight_bytes + 28 * 64 * 2  # only embedding rows grow
    with pytest.raises(StepError, match="batch 0"):
        forward_time(MEMBOUND, toy(), q=1, batch=0)


def test_overheads_and_draft_time():
    hw = HardwareProfile("toy-oh", 1.0, 1e9, None, 0.0, fixed_overhead_ms=1.0, per_layer_overhead_ms=0.25)
    m = toy()
    assert forward_time(hw, m, 1, 1, 10).overhead_ms == 1.0 + 2 * 0.25
    assert forward_time(hw, m, 1, 1, 10, overheads=False).overhead_ms == 0.0
    # A chain drafter runs k one-token forwards; a block drafter one forward of k tokens.
    chain = draft_time(hw, Drafter("model", m), 3, 1, 10)
    assert chain == pytest.approx(sum(forward_time(hw, m, 1, 1, 10 + i).total_ms for i in range(3)))
    assert draft_time(hw, Drafter("block", m), 3, 1, 10) == pytest.approx(forward_time(hw, m, 3, 1, 10).total_ms)
    assert draft_time(hw, Drafter.ngram(), 3, 4, 10) == pytest.approx(4 * 0.005)
    with pytest.raises(StepError, match="drafter-config"):
        Drafter("block")


def test_sd_step_tokens_and_tau_bounds():
    m = toy()
    step = sd_step(MEMBOUND, m, Drafter("ngram", host_ms=0.5), k=3, tau=2.0, batch=2, context=10)
    assert step.step_ms == pytest.approx(2 * 0.5 + step.verify.total_ms)
    assert step.ms_per_token == pytest.approx(step.step_ms / 4)
    assert step.latency_ms_per_token == pytest.approx(step.step_ms / 2)
    with pytest.raises(StepError, match="tau 5"):
        sd_step(MEMBOUND, m, Drafter.ngram(), k=3, tau=5.0)


# -- ceilings and plausible ----------------------------------------------------------------------


def test_ceiling_by_hand():
    drafter = Drafter("ngram", host_ms=0.0)
    # AR: weights 161024 B + KV 11 * 256 B = 163840 B -> 0.16384 ms. Oracle k = 3 verifies 4 tokens:
    # weights (80448 + 4 * 64) * 2 = 161408 B + KV 14 * 256 = 3584 B -> 0.164992 ms for 4 tokens.
    c = ceiling(MEMBOUND, toy(), drafter, k=3, context=10)
    assert c.oracle and c.tau == 4
    assert c.ar_ms_per_token == pytest.approx(0.16384)
    assert c.ideal_sd_ms_per_token == pytest.approx(0.164992 / 4)
    assert c.speedup == pytest.approx(0.16384 / 0.041248)
    measured_tau = ceiling(MEMBOUND, toy(), drafter, k=3, tau=2.0, context=10)
    assert measured_tau.speedup == pytest.approx(0.16384 / (0.164992 / 2))
    # Overheads count on the AR side (stock runs with them), never on the ideal SD side.
    hw = HardwareProfile("toy-oh", 1.0, 1e9, None, 0.0, fixed_overhead_ms=1.0)
    assert ceiling(hw, toy(), drafter, k=3, context=10).speedup == pytest.approx(1.16384 / 0.041248)
    # A measured AR time replaces the modelled one.
    assert ceiling(MEMBOUND, toy(), drafter, k=3, context=10, ar_ms_per_token=2.0).speedup == \
        pytest.approx(2.0 / 0.041248)


def test_batch_ceiling_falls_once_verify_turns_compute_bound():
    # 1 GB/s and 0.1 TFLOPS: one request is memory-bound, 64 requests verifying 5 tokens are not.
    hw = HardwareProfile("toy-mixed", 1.0, 0.1, None, 0.0)
    m = toy()
    one = ceiling(hw, m, Drafter("ngram", host_ms=0.0), k=4, batch=1, context=10)
    many = ceiling(hw, m, Drafter("ngram", host_ms=0.0), k=4, batch=64, context=10)
    assert forward_time(hw, m, 5, 64, 10).bound == "compute"
    assert one.speedup > 4.5
    assert many.speedup < 0.75 * one.speedup


def test_plausible():
    ok, reason = plausible(2.0, 3.0)
    assert ok and "2.00x" in reason and "3.00x" in reason
    assert plausible(3.29, 3.0)[0]
    ok, reason = plausible(3.31, 3.0)
    assert not ok and "3.31x" in reason and "\n" not in reason
    assert not plausible(math.nan, 3.0)[0]
    assert not plausible(-1.0, 3.0)[0]
    with pytest.raises(ValueError, match="ceiling"):
        plausible(1.0, 0.0)
    dep = CostDeployment("toy", MEMBOUND, toy(), Drafter("ngram", host_ms=0.0), draft_len=3, context=10)
    assert dep.oracle_ceiling() == pytest.approx(0.16384 / 0.041248)
    ok, reason = plausible(4.5, dep)
    assert not ok and "toy" in reason
    assert plausible(3.9, dep)[0]


# -- gaps ----------------------------------------------------------------------------------------

ENTRY = {"name": "sd-draft-model", "tokens_per_s": 120.0, "tau": 2.5, "draft_len": 4, "speedup_vs_ar": 1.8,
         "phase_ms_per_token": {"prefill": 0.5, "draft": 2.0, "verify": 5.0, "accept": 0.3, "other": 0.2}}


def test_measured_gaps_by_hand_and_sum_to_measured():
    b = measured_gaps(ENTRY, MEMBOUND, toy(), context=10)
    assert b.measured_ms_per_token == pytest.approx(1000 / 120)
    parts = {g.name: g for g in b.components}
    # 1 / tau = 0.4 verify forwards per token, each q = 5: weights (80448 + 5 * 64) * 2 B, KV 15 * 256 B.
    assert parts["weight reads"].ms_per_token == pytest.approx(0.4 * 0.161536)
    assert parts["KV reads"].ms_per_token == pytest.approx(0.4 * 0.00384)
    assert parts["compute"].ms_per_token == 0.0
    assert parts["host/launch overhead"].ms_per_token == pytest.approx(5.0 - 0.4 * (0.161536 + 0.00384))
    assert parts["drafting"].family == "drafting" and parts["drafting"].ms_per_token == 2.0
    assert parts["bookkeeping"].ms_per_token == 0.3
    # Wall time outside the phases (8.3333 - 8.0) lands in "other host time".
    assert parts["other host time"].ms_per_token == pytest.approx(0.2 + 1000 / 120 - 8.0)
    assert b.components_sum == pytest.approx(b.measured_ms_per_token, abs=1e-12)
    check_accounting(b)
    # Acceptance: (2.0 + 5.0 + 0.3) per token = 18.25 per step; an oracle spreads it over 5 tokens.
    assert b.acceptance_gap.ms_per_token == pytest.approx(7.3 - 18.25 / 5)
    assert b.acceptance_gap.could_save and b.acceptance_gap.family == "acceptance"
    ranked = b.ranked()
    assert [g.ms_per_token for g in ranked] == sorted((g.ms_per_token for g in ranked), reverse=True)
    assert ranked[0].name == "host/launch overhead"


def test_measured_gaps_when_the_roofline_overpredicts():
    crawl = HardwareProfile("crawl", 0.0001, 1e9, None, 0.0)  # 100 kB/s: roofline far above the measurement
    b = measured_gaps(ENTRY, crawl, toy(), context=10)
    check_accounting(b)
    parts = {g.name: g.ms_per_token for g in b.components}
    assert parts["host/launch overhead"] == 0.0
    assert parts["weight reads"] + parts["KV reads"] == pytest.approx(5.0)
    assert any("underrates" in n for n in b.notes)


def test_measured_gaps_counts_and_errors():
    entry = {**ENTRY, "target_forwards": 45, "new_tokens": 100}
    b = measured_gaps(entry, MEMBOUND, toy(), context=10, num_prompts=5)  # (45 - 5) / 100 = 0.4 per token
    assert {g.name: g for g in b.components}["weight reads"].ms_per_token == pytest.approx(0.4 * 0.161536)
    ar = measured_gaps({"name": "ar", "tokens_per_s": 100.0, "tau": 1.0, "draft_len": None,
                        "phase_ms_per_token": {"prefill": 1, "draft": 0, "verify": 8, "accept": 0, "other": 1}},
                       MEMBOUND, toy(), context=10)
    assert ar.acceptance_gap.ms_per_token == 0.0
    check_accounting(ar)
    with pytest.raises(GapError, match="phase_ms_per_token"):
        measured_gaps({"name": "hf-greedy", "tau": 1.0}, MEMBOUND, toy(), context=10)


def test_check_accounting_can_fail():
    b = measured_gaps(ENTRY, MEMBOUND, toy(), context=10)
    broken = type(b)(b.method, b.measured_ms_per_token + 1.0, b.components, b.acceptance_gap, b.tau, b.oracle_tau)
    with pytest.raises(AssertionError, match="off by"):
        check_accounting(broken)


def test_modelled_gaps_sum_to_the_projected_step():
    hw = HardwareProfile("toy-oh", 1.0, 1e9, None, 0.0, fixed_overhead_ms=0.1)
    m = toy()
    b = modelled_gaps(hw, m, Drafter("model", m), k=3, tau=2.0, batch=4, context=10)
    step = sd_step(hw, m, Drafter("model", m), 3, 2.0, 4, 10)
    assert b.measured_ms_per_token == pytest.approx(step.step_ms / 8)
    check_accounting(b)
    assert b.acceptance_gap.ms_per_token == pytest.approx(step.step_ms / 8 - step.step_ms / 16)


def test_ceiling_with_overheads_is_tighter():
    hw = HardwareProfile("toy-oh", 1.0, 1e9, None, 0.0, fixed_overhead_ms=1.0)
    hard = ceiling(hw, toy(), Drafter("ngram", host_ms=0.0), k=3, context=10)
    soft = ceiling(hw, toy(), Drafter("ngram", host_ms=0.0), k=3, context=10, sd_overheads=True)
    # AR 1.16384 ms; oracle SD with the 1 ms overhead: (0.164992 + 1.0) / 4 per token.
    assert soft.speedup == pytest.approx(1.16384 / (1.164992 / 4))
    assert soft.speedup < hard.speedup


def test_method_entry_round_trips_the_bench_contract_and_names_bad_fields():
    entry = {**ENTRY, "target_forwards": 45, "new_tokens": 100, "divergences": []}
    e = MethodEntry.from_dict(entry)
    assert (e.tau, e.draft_len, e.target_forwards, e.speedup_vs_ar) == (2.5, 4, 45, 1.8)
    back = e.as_dict()
    assert {k: back[k] for k in entry} == entry  # every field a bench wrote comes back unchanged
    assert measured_gaps(e, MEMBOUND, toy(), context=10).as_dict() == \
        measured_gaps(entry, MEMBOUND, toy(), context=10).as_dict()
    with pytest.raises(GapError, match="tau 0 must be positive"):
        read_entry({**ENTRY, "tau": 0})
    with pytest.raises(GapError, match="lacks verify"):
        read_entry({**ENTRY, "phase_ms_per_token": {"prefill": 1, "draft": 0, "accept": 0, "other": "x"}})
    with pytest.raises(GapError, match="JSON object"):
        read_entry([1, 2])
