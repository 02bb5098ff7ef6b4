"""The shared-prompt training forward (`trl_async/trainers/forward.py`): the same log-probs, entropies and gradients as
TRL's forward, with each prompt computed once per group."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from tests.support.trainer_utils import answer_reward, load_tokenizer, make_args
from trl_async import AsyncGRPOTrainer
from trl_async.toy import make_arithmetic_dataset, tiny_model_path
from trl_async.trainers import forward as shared_prompt
from trl_async.trainers.forward import pack_prompt_groups, prefix_forward, split_prompt_prefix


def grpo_batch(seed=0, groups=3, group_size=4, prompt_width=9, completion_width=7, vocab=400, min_completion=1):
    """TRL's layout: left-padded prompts of different lengths, `group_size` right-padded completions each, rows
    shuffled (TRL shuffles a generation batch before splitting it)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, prompt_width + 1, (), generator=g)),), generator=g)
        for _ in range(group_size):
            length = int(torch.randint(min_completion, completion_width + 1, (), generator=g))
            rows.append((prompt, torch.randint(3, vocab, (length,), generator=g)))
    width = prompt_width + completion_width
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, prompt_width - len(prompt) : prompt_width] = prompt
        mask[i, prompt_width - len(prompt) : prompt_width] = 1
        ids[i, prompt_width : prompt_width + len(completion)] = completion
        mask[i, prompt_width : prompt_width + len(completion)] = 1
    order = torch.randperm(len(rows), generator=g)
    return ids[order], mask[order], completion_width


def test_each_completion_token_sees_exactly_its_unpacked_context():
    """For every completion token: the (token, position) pairs it may attend to in the packed batch are those of its
    unpacked row (the real prompt tokens, then its completion up to itself), and it sits at its unpacked position."""
    ids, mask, L = grpo_batch(seed=1)
    P = ids.size(1) - L
    packed = pack_prompt_groups(ids, mask, L)
    assert packed is not None and packed.input_ids.size(0) == 3
    # Exactly the completions' real tokens are labelled: no right padding is packed.
    assert int((packed.labels != -100).sum()) == int(mask[:, P:].sum())
    lengths = [int(mask[row, P:].nonzero().max()) + 1 for row in range(ids.size(0))]
    assert packed.row_length.tolist() == lengths
    assert packed.input_ids.size(1) == max(
        (P - 1) + sum(1 + n for n, g in zip(lengths, packed.row_group.tolist(), strict=True) if g == group)
        for group in range(3)
    )
    for row in range(ids.size(0)):
        group, start = int(packed.row_group[row]), int(packed.row_start[row])
        for j in range(L):
            if not mask[row, P + j]:
                if j < lengths[row]:
                    assert packed.labels[group, start + 1 + j] == -100
                continue
            query = start + 1 + j  # where completion token j sits in the packed sequence
            assert packed.input_ids[group, query] == ids[row, P + j]
            assert packed.position_ids[group, query] == P + j
            assert packed.labels[group, query] == ids[row, P + j]
            seen = {
                (int(packed.input_ids[group, t]), int(packed.position_ids[group, t]))
                for t in torch.nonzero(packed.allowed[group, query]).flatten().tolist()
            }
            expected = {(int(ids[row, t]), t) for t in range(P + j + 1) if mask[row, t]}
            assert seen == expected, (row, j)


def test_distinct_prompts_are_not_packed_and_savings_are_required():
    ids, mask, L = grpo_batch(groups=6, group_size=1)
    assert pack_prompt_groups(ids, mask, L) is None  # nothing shared: TRL's forward
    ids, mask, L = grpo_batch(groups=2, group_size=4)
    assert pack_prompt_groups(ids, mask, L) is not None
    assert pack_prompt_groups(ids, mask, L, min_saving=0.99) is None


def tiny_model_with_fused_head(attn_implementation, checkpointing):
    """The tiny model with TRL's fused LM head, in training mode, checkpointed as TRL does (non-reentrant) if asked."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation=attn_implementation)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_equals_trls_forward_with_gradients(attn_implementation, checkpointing):
    model = tiny_model_with_fused_head(attn_implementation, checkpointing)
    ids, mask, L = grpo_batch(seed=2)

    # TRL's forward (`GRPOTrainer._get_per_token_logps_and_entropies`): labels on the completion tokens only.
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-L] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    reference_logps, reference_entropy = out.log_probs[:, -L:], out.entropy[:, -L:]
    weights = torch.randn(reference_logps.shape)  # a loss that weighs every token differently
    ((reference_logps * weights).sum() + reference_entropy.sum()).backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    packed = pack_prompt_groups(ids, mask, L)
    assert packed.input_ids.numel() < 0.8 * ids.numel()
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask(attn_implementation, torch.float32),
        position_ids=packed.position_ids,
        labels=packed.labels,
        fused_lm_head=True,
    )
    logps, entropy = packed.unpack(out.log_probs), packed.unpack(out.entropy)
    torch.testing.assert_close(logps, reference_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, reference_entropy, atol=1e-5, rtol=1e-5)
    ((logps * weights).sum() + entropy.sum()).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference_grads[name], atol=1e-4, rtol=1e-4, msg=name)


def test_the_trainer_packs_its_forward_and_gets_trls_numbers(tmp_path):
    """`AsyncGRPOTrainer._get_per_token_logps_and_entropies` on a real GRPO batch: 'on' feeds the model fewer tokens
    (one sequence per prompt) and returns what 'off' (TRL's forward) returns."""
    dataset = make_arithmetic_dataset(num_train=32, num_test=4, seed=0)["train"]
    args = make_args(tmp_path, async_generation=False, gradient_checkpointing=False)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_path(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    rows = [row for row in dataset.select(range(2)).to_list() for _ in range(4)]  # TRL's sampler repeats prompts
    batch = trainer._generate_and_score_completions(rows)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    widths = []
    handle = trainer.model.register_forward_pre_hook(
        lambda m, a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True
    )
    results = {}
    for mode in ("off", "on"):
        trainer.args.shared_prompt_forward = mode
        widths.clear()
        results[mode] = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1), compute_entropy=True
        )
        results[mode + "_shape"] = widths[0]
    handle.remove()
    assert results["off_shape"] == input_ids.shape
    assert results["on_shape"][0] == 2  # 8 rows, 2 prompts of 4 generations
    assert results["on_shape"].numel() < input_ids.numel()
    torch.testing.assert_close(results["on"][0], results["off"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["on"][1], results["off"][1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ prompt as a prefix
def test_each_completion_token_sees_its_prompt_prefix_and_itself():
    """For every completion token of every row: the (token, position) pairs it may attend to, across its group's
    prefix and its own suffix, are those of its unpacked row, it sits at its unpacked position, and it is labelled
    as TRL labels it."""
    ids, mask, L = grpo_batch(seed=3)
    P = ids.size(1) - L
    prefix = split_prompt_prefix(ids, mask, L)
    assert prefix is not None and prefix.prefix_ids.shape == (3, P - 1)
    assert prefix.suffix_ids.shape == (ids.size(0), 1 + L)
    trl_labels = ids.masked_fill(mask == 0, -100)[:, P:]
    assert torch.equal(prefix.labels[:, 1:], trl_labels) and bool((prefix.labels[:, 0] == -100).all())
    for row in range(ids.size(0)):
        group = int(prefix.row_group[row])
        keys = [
            (int(t), int(p)) for t, p in zip(prefix.prefix_ids[group], prefix.prefix_position_ids[group], strict=True)
        ]
        keys += [
            (int(t), int(p)) for t, p in zip(prefix.suffix_ids[row], prefix.suffix_position_ids[row], strict=True)
        ]
        for j in range(L):
            if not mask[row, P + j]:
                continue
            query = 1 + j  # completion token j in the suffix
            assert prefix.suffix_ids[row, query] == ids[row, P + j]
            assert prefix.suffix_position_ids[row, query] == P + j
            seen = {keys[t] for t in torch.nonzero(prefix.suffix_allowed[row, query]).flatten().tolist()}
            assert seen == {(int(ids[row, t]), t) for t in range(P + j + 1) if mask[row, t]}, (row, j)
    for group in range(3):  # the prefixes attend causally to their real tokens
        row = int((prefix.row_group == group).nonzero()[0])
        for q in range(P - 1):
            if not mask[row, q]:
                continue
            seen = set(torch.nonzero(prefix.prefix_allowed[group, q]).flatten().tolist())
            assert seen == {t for t in range(q + 1) if mask[row, t]}


def test_distinct_prompts_get_no_prefix_and_savings_are_required():
    ids, mask, L = grpo_batch(groups=6, group_size=1)
    assert split_prompt_prefix(ids, mask, L) is None
    ids, mask, L = grpo_batch(groups=2, group_size=4)
    assert split_prompt_prefix(ids, mask, L) is not None
    assert split_prompt_prefix(ids, mask, L, min_saving=0.99) is None


def count_tokens(module):
    """Tokens each forward of `module` is given, as a list that the returned hook's calls append to."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_prefix_forward_equals_trls_forward_with_gradients(attn_implementation, checkpointing):
    """Long completions (where packing declines): the prompts run once as a key/value prefix, the completions
    attend to it; the log-probs, entropies and every gradient are TRL's forward's, also when gradient checkpointing
    replays the layers in the backward pass."""
    model = tiny_model_with_fused_head(attn_implementation, checkpointing)
    ids, mask, L = grpo_batch(seed=4, groups=3, group_size=4, prompt_width=9, completion_width=40, min_completion=38)
    assert pack_prompt_groups(ids, mask, L) is None  # the regime this path is for

    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-L] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    reference_logps, reference_entropy = out.log_probs[:, -L:], out.entropy[:, -L:]
    weights = torch.randn(reference_logps.shape)
    ((reference_logps * weights).sum() + reference_entropy.sum()).backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    prefix = split_prompt_prefix(ids, mask, L)
    backbone_tokens, backbone_hook = count_tokens(model.base_model)
    out = prefix_forward(model, model.base_model, prefix, attn_implementation, torch.float32)
    backbone_hook.remove()
    P = ids.size(1) - L
    assert backbone_tokens == [3 * (P - 1), ids.size(0) * (1 + L)]  # each prompt once, then the completions
    torch.testing.assert_close(out.log_probs, reference_logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, reference_entropy, atol=1e-5, rtol=1e-5)
    ((out.log_probs * weights).sum() + out.entropy.sum()).backward()
    for name, parameter in model.named_parameters():  # float32 sums in another order: tolerance at each one's scale
        scale = float(reference_grads[name].abs().max())
        torch.testing.assert_close(parameter.grad, reference_grads[name], atol=1e-5 * scale, rtol=1e-4, msg=name)


def long_completion_trainer(tmp_path, **kwargs):
    dataset = make_arithmetic_dataset(num_train=32, num_test=4, seed=0)["train"]
    args = make_args(tmp_path, async_generation=False, **kwargs)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_path(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    if args.gradient_checkpointing:  # as `Trainer.train` enables it, with TRL's settings (non-reentrant)
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    ids, mask, L = grpo_batch(seed=5, groups=2, group_size=4, prompt_width=9, completion_width=40, min_completion=36)
    return trainer, ids, mask, L


def trainer_forward(trainer, mode, input_ids, attention_mask, logits_to_keep):
    trainer.args.shared_prompt_forward = mode
    tokens, handle = count_tokens(trainer.model.base_model)
    try:
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, logits_to_keep, compute_entropy=True
        )
    finally:
        handle.remove()
    return logps, entropies, tokens


def test_the_trainer_runs_long_completions_with_the_prompt_as_prefix(tmp_path):
    """With completions long enough that packing declines, 'on' runs the two prompts once and the 8 rows'
    completions after them (fewer tokens than TRL's forward), and returns what 'off' (TRL's forward) returns."""
    trainer, input_ids, attention_mask, L = long_completion_trainer(tmp_path, gradient_checkpointing=True)
    assert pack_prompt_groups(input_ids, attention_mask, L) is None
    off = trainer_forward(trainer, "off", input_ids, attention_mask, L)
    on = trainer_forward(trainer, "on", input_ids, attention_mask, L)
    P = input_ids.size(1) - L
    assert off[2] == [input_ids.numel()]
    assert on[2] == [2 * (P - 1), 8 * (1 + L)]
    torch.testing.assert_close(on[0], off[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on[1], off[1], atol=1e-5, rtol=1e-5)


def test_a_lora_policy_runs_long_completions_with_the_prompt_as_prefix(tmp_path):
    """LoRA (the recipe's configuration): the prefix runs through the base model's backbone with the adapters in it,
    and the log-probs and the adapters' gradients equal TRL's forward."""
    from peft import LoraConfig

    dataset = make_arithmetic_dataset(num_train=32, num_test=4, seed=0)["train"]
    args = make_args(tmp_path, async_generation=False, gradient_checkpointing=True)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_path(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
        # Random A and B (PEFT's default B = 0 makes the adapters a no-op in the forward): a prefix without them
        # would give other log-probs.
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )  # fmt: skip
    model = trainer.model
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    ids, mask, L = grpo_batch(seed=5, groups=2, group_size=4, prompt_width=9, completion_width=40, min_completion=36)
    weights = torch.linspace(-1.0, 1.0, ids.size(0) * L).view(ids.size(0), L)
    results = {}
    for mode in ("off", "on"):
        trainer.args.shared_prompt_forward = mode
        tokens, handle = count_tokens(model.get_base_model().base_model)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, L, compute_entropy=True)
        handle.remove()
        ((logps * weights).sum() + entropies.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad()
        results[mode] = (logps.detach(), entropies.detach(), grads, tokens)
    with torch.no_grad(), model.disable_adapter():
        trainer.args.shared_prompt_forward = "off"
        without_adapters = trainer._get_per_token_logps_and_entropies(model, ids, mask, L)[0]
    assert not torch.allclose(without_adapters, results["off"][0], atol=1e-3)
    P = ids.size(1) - L
    assert results["off"][3] == [ids.numel()]
    assert results["on"][3] == [2 * (P - 1), 8 * (1 + L)]
    assert results["on"][2] and all("lora_" in name for name in results["on"][2])
    torch.testing.assert_close(results["on"][0], results["off"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["on"][1], results["off"][1], atol=1e-5, rtol=1e-5)
    for name, reference in results["off"][2].items():
        scale = float(reference.abs().max())
        torch.testing.assert_close(results["on"][2][name], reference, atol=1e-5 * scale, rtol=1e-4, msg=name)


def test_transformers_whose_checkpointed_layers_drop_a_cache_run_trls_forward(tmp_path, monkeypatch):
    """Before transformers 5.20 (no `_can_checkpoint_with_cache`), a checkpointed layer drops any cache argument and
    the completions would run without their prompt: the trainer runs TRL's forward there."""
    trainer, input_ids, attention_mask, L = long_completion_trainer(tmp_path, gradient_checkpointing=True)
    monkeypatch.setattr(shared_prompt, "_checkpointed_layers_may_keep_a_cache", lambda: False)
    on = trainer_forward(trainer, "on", input_ids, attention_mask, L)
    assert on[2] == [input_ids.numel()]


def test_reentrant_checkpointing_runs_trls_forward(tmp_path):
    """Reentrant checkpointing runs each layer without autograd, which would cut the prompt's keys and values from
    the graph: the trainer does not use the prefix then."""
    trainer, input_ids, attention_mask, L = long_completion_trainer(tmp_path, gradient_checkpointing=False)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    on = trainer_forward(trainer, "on", input_ids, attention_mask, L)
    assert on[2] == [input_ids.numel()]
