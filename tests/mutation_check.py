"""Mutation check: every guarantee the project claims has a test that fails when the guarantee is broken.

    python tests/mutation_check.py              # every mutation, one at a time
    python tests/mutation_check.py --jobs 2     # two mutants at once, each in its own copy (CI's command)
    python tests/mutation_check.py --list       # the mutations and the tests that guard them
    python tests/mutation_check.py --only eviction_off,seqlock_no_recheck

Each mutation is a small, plausible bug, written as an exact text replacement in one file (the replaced text must occur
exactly once, so a refactor that removes it fails this script loudly, before any mutant runs, instead of silently
testing nothing). For each one, the repository is copied to a temporary directory, the mutation applied there, and the tests that guard the
behaviour are run against the copy. A mutation that leaves its tests green SURVIVES: a missing test. The script exits
non-zero if any mutation survives. Reading the list below tells what each test is for.

Each mutant's pytest is forked from a server that imported the third-party libraries once (`GUARD_PRELOAD`; never the
project's own code, which every mutant imports from its copy), after a baseline run of two guards on the unmutated copy.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    guards: tuple[str, ...]  # pytest node ids / files (relative to the repository root)
    why: str
    timeout: float | None = None  # seconds; a mutant that hangs its guards past this is counted as killed


PPO_STALE_TEST = (
    "tests/test_ppo_trainer.py::test_stale_batch_reused_across_steps_gives_ppo_targets_and_loss_computed_independently"
)

M2PO_GLOBAL_TRAINER_TEST = (
    "tests/test_m2po_trainer.py::test_global_scope_in_a_two_process_training_step_masks_as_algorithm_1_over_both_ranks"
)

M2PO_TRAINING_VALUES_TEST = (
    "tests/test_m2po_trainer.py::test_m2po_training_loss_and_metrics_equal_the_rule_recomputed_from_the_weights"
)
M2PO_SYNC_TEST = "tests/test_losses.py::test_cuda_sync_promise_checked_on_cpu"
STEP_SYNC_TEST = (
    "tests/test_step_host_syncs.py::test_a_training_micro_step_corrects_and_records_with_at_most_the_selections_sync"
)
CLIPPED_IN_OWN_DTYPE_TEST = (
    "tests/test_correction.py::test_truncated_weights_on_a_bound_are_counted_as_clipped_in_their_own_dtype"
)
CLIPPED_PER_ROW_TEST = "tests/test_correction.py::test_truncated_sequence_weights_on_a_bound_are_counted_per_row"
RESUME_CHAIN_TEST = "tests/test_resume_and_failures.py::test_resume_twice_in_a_row_continues_exactly_on_policy"

DIVERGING_TEST = "tests/test_diverging_ranks.py::test_ranks_that_differ_stay_in_step"

BAD_INPUT_TEST = "tests/test_bad_inputs.py::test_bad_input_is_a_clear_error_and_leaves_nothing_behind"

AGENTIC_TEST = "tests/test_agentic.py"

MULTI_BATCH_TEST = "tests/test_multi_batch_decode.py"
TAKE_OVER_TEST = "test_a_generator_ready_while_the_trainer_trains_takes_over_at_the_next_batch"
FAST_START_TEST = (
    "test_the_generation_process_builds_its_lora_copy_from_the_published_weights_without_a_copy_of_the_base"
)


def bad_input(*case_ids: str) -> tuple[str, ...]:
    """The cases of `tests/test_bad_inputs.py`'s table that guard a check."""
    return tuple(f"{BAD_INPUT_TEST}[{case_id}]" for case_id in case_ids)


MUTATIONS = [
    # --------------------------------------------------------------------------------------- staleness guarantee
    Mutation(
        "tag_with_newest_version_at_put",
        "trl_async/rollout/generator.py",
        "rollout_queue.put(first + offset, version, payload",
        "rollout_queue.put(first + offset, trainable_store.version, payload",
        ("tests/test_engine.py::test_no_row_older_than_max_staleness_reaches_a_loss",),
        "rows tagged with the newest published version instead of the one that generated them",
    ),
    Mutation(
        "eviction_off",
        "trl_async/rollout/queue.py",
        "if staleness > self.max_staleness:",
        "if False:",
        (
            "tests/test_engine.py::test_forced_eviction_in_a_real_run_skips_stale_batches_and_finishes",
            "tests/test_queue.py",
        ),  # fmt: skip
        "stale items are trained on instead of evicted",
    ),
    Mutation(
        "last_use_off_by_one",
        "trl_async/trainers/engine.py",
        "return self.state.global_step + versions_until_last_use(self._step, g, a)",
        "return self.state.global_step - 1 + versions_until_last_use(self._step, g, a)",
        ("tests/test_engine.py::test_forced_eviction_in_a_real_run_skips_stale_batches_and_finishes",),
        "the trainer's last-use version is one step early: rows one step too old pass the bound",
    ),
    Mutation(
        "schedule_term_dropped",
        "trl_async/trainers/engine.py",
        "return self.state.global_step + versions_until_last_use(self._step, g, a)",
        "return self.state.global_step",
        ("tests/test_engine.py::test_forced_eviction_in_a_real_run_skips_stale_batches_and_finishes",),
        "a batch trained on across several optimizer steps is checked at its first use only",
    ),
    Mutation(
        "gate_open",
        "trl_async/rollout/queue.py",
        "(wait_for_weights and c.published < needed)",
        "(wait_for_weights and False)",
        ("tests/test_queue.py",),
        "the producer generates without waiting for recent enough weights",
    ),
    Mutation(
        "no_cross_rank_agreement",
        "trl_async/rollout/queue.py",
        "staleness = local if agree is None else agree(local)",
        "staleness = local",
        ("tests/test_queue.py",),
        "ranks evict different items, so the batches they train on together no longer belong together",
    ),
    # --------------------------------------------------------------------------------------- resume
    Mutation(
        "stream_position_saved_without_the_resumed_offset",
        "trl_async/rollout/pipeline.py",
        '"stream_position": self._stream_offset + self._next_index,',
        '"stream_position": self._next_index,',
        (RESUME_CHAIN_TEST,),
        "a resumed run saves the batches it consumed itself, not its stream position: resuming it again replays batches",
    ),
    Mutation(
        "resume_restarts_the_prompt_stream",
        "trl_async/rollout/pipeline.py",
        'spec = dataclasses.replace(spec, stream_offset=int(self._restored["stream_position"]))',
        "spec = dataclasses.replace(spec, stream_offset=0)",
        (RESUME_CHAIN_TEST,),
        "a resumed run generates from the first batch of the prompt stream again",
    ),
    # --------------------------------------------------------------------------------------- weights
    Mutation(
        "seqlock_no_recheck",
        "trl_async/rollout/weights.py",
        "if self._sequence.value == before:",
        "if True:",
        ("tests/test_weights.py",),
        "a reader may apply a half-written mix of two weight versions",
    ),
    Mutation(
        "no_weight_publish",
        "trl_async/rollout/pipeline.py",
        "self.trainable_store.publish(iter_full_parameters([(n, trainable[n]) for n in self._trainable_names]), version)",
        "pass",
        ("tests/test_engine.py::test_no_row_older_than_max_staleness_reaches_a_loss",),
        "the generator keeps sampling from the start-up weights (its gate then waits forever: a hang is a kill)",
        timeout=90.0,  # the guard passes in ~25 s on the real code; a hang would otherwise run to its 300 s
    ),
    # --------------------------------------------------------------------------------------- importance correction
    Mutation(
        "importance_correction_off",
        "trl_async/trainers/engine.py",
        "and bool(self.args.vllm_importance_sampling_correction)",
        "and False",
        ("tests/test_importance_trainer.py",),
        "TRL's loss types train on stale rows without the π_old/μ weight",
    ),
    Mutation(
        "importance_weight_inverted",
        "trl_async/trainers/correction.py",
        "        old_logps, behaviour_logps, mask, mode=settings.mode,",
        "        behaviour_logps, old_logps, mask, mode=settings.mode,",
        ("tests/test_importance_trainer.py",),
        "the weight is μ/π_old instead of π_old/μ",
    ),
    Mutation(
        "truncated_weights_upcast_before_the_bound_check",
        "trl_async/trainers/correction.py",
        '    weights = weights.detach()\n    if settings.mode.endswith("mask"):',
        '    weights = weights.detach().to(torch.float64)\n    if settings.mode.endswith("mask"):',
        (CLIPPED_IN_OWN_DTYPE_TEST, CLIPPED_PER_ROW_TEST),
        "float32 weights held at 1.2 are upcast before the comparison: sampling/.../clipped_fraction misses them",
    ),
    Mutation(
        "truncation_bound_of_zero_dropped",
        "trl_async/algorithms/importance.py",
        "        if bound is not None:\n            on_bound |= weights == bound",
        "        if bound:\n            on_bound |= weights == bound",
        (CLIPPED_IN_OWN_DTYPE_TEST,),
        "clip_min=0.0 is no bound for the clipped figures: a weight held at 0 is not counted as clipped",
    ),
    # --------------------------------------------------------------------------------------- behaviour log-probs
    Mutation(
        "mu_from_raw_logits",
        "trl_async/rollout/backends/hf.py",
        "processors.append(recorder)",
        "processors.insert(0, recorder)",
        ("tests/test_backends.py",),
        "μ recorded before temperature/top-k/top-p: not the distribution that sampled the token",
    ),
    Mutation(
        "importance_against_processed_mu",
        "trl_async/rollout/backends/base.py",
        "return self.policy_logprobs if self.policy_logprobs is not None else self.logprobs",
        "return self.logprobs",
        (
            "tests/test_importance_trainer.py::test_sampling_warpers_leave_the_weight_at_one_at_staleness_zero",
            "tests/test_backends.py::test_behaviour_logprobs_equal_the_processed_distribution",
        ),
        "the importance weight compares π_θ with the warped μ: under top-k it is far from 1 even at staleness 0",
    ),
    Mutation(
        "seed_ignores_rank",
        "trl_async/rollout/producer.py",
        'f"{seed}/{process_index}/{stream_index}"',
        'f"{seed}/{stream_index}"',
        ("tests/test_engine.py::test_ranks_sharing_a_group_never_sample_identical_completions",),
        "two ranks sample identical completions for the halves of one group",
    ),
    # --------------------------------------------------------------------------------------- rewards
    Mutation(
        "always_decode",
        "trl_async/rollout/producer.py",
        "        if spec.decode:\n            sampled.decode()",
        "        sampled.decode()",
        ("tests/test_tensor_rewards_trainer.py",),
        "completions are decoded although only tensor rewards read them",
    ),
    Mutation(
        "answer_without_number_boundary",
        "trl_async/rewards/math_answer.py",
        "return ((found == keys) & ends).any(1)",
        "return (found == keys).any(1)",
        ("tests/test_math_answer_reward.py",),
        "the gold answer 42 matches the start of 421",
    ),
    # --------------------------------------------------------------------------------------- M2PO
    Mutation(
        "m2po_normalizer_ignores_accumulation",
        "trl_async/trainers/engine.py",
        """        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer""",
        """        return normalizer""",
        ("tests/test_m2po_trainer.py::test_trainer_m2po_loss_equals_an_independent_computation",),
        "M2PO's loss is normalized by the generation batch, not by the accumulation window (TRL dapo's normalizer)",
    ),
    Mutation(
        "m2po_paper_without_trust_region",
        "trl_async/algorithms/m2po/selection.py",
        "sign = _broadcast_advantages(advantages.detach().to(device=device, dtype=torch.float32), delta).sign()",
        "sign = _broadcast_advantages(advantages.detach().to(device=device, dtype=torch.float32), delta).sign().abs()",
        ("tests/test_losses.py", "tests/test_losses_paper_heldout.py"),
        "the trust region ignores the advantage's sign: tokens moving against their advantage become candidates",
    ),
    Mutation(
        "m2po_against_the_policy_at_batch_time",
        "trl_async/trainers/grpo.py",
        'behaviour = rollout_view(inputs)["sampling_per_token_logps"]\n        elif',
        "behaviour = per_token_logps.detach()\n        elif",
        (M2PO_TRAINING_VALUES_TEST,),
        "M2PO measures δ against the policy of the loss's own forward, not μ: stale rows are never masked",
    ),
    Mutation(
        "m2po_m2_after_over_every_valid_token",
        "trl_async/algorithms/m2po/stats.py",
        "d2_kept / kept if kept else 0.0,",
        "d2_kept / valid if valid else 0.0,",
        (M2PO_TRAINING_VALUES_TEST,),
        "the logged m2po/m2_after divides the kept tokens' δ² by every valid token",
    ),
    Mutation(
        "m2po_global_selection_not_applied",
        "trl_async/trainers/grpo.py",
        "normalizer=normalizer, selection=selection\n",
        "normalizer=normalizer, selection=None\n",
        (M2PO_GLOBAL_TRAINER_TEST,),
        "m2po_scope='global' selects over both ranks but the loss masks each rank's micro-batch on its own",
    ),
    Mutation(
        "m2po_global_selection_without_the_other_ranks",
        "trl_async/algorithms/m2po/global_scope.py",
        "world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1",
        "world = 1",
        (M2PO_GLOBAL_TRAINER_TEST,),
        "the global selection sees only this rank's tokens (no gather): each rank's mask is a per-rank one",
    ),
    Mutation(
        "m2po_global_keep_read_at_rank0s_offset",
        "trl_async/algorithms/m2po/global_scope.py",
        "offset=sum(counts[:rank]),",
        "offset=0,",
        (M2PO_GLOBAL_TRAINER_TEST,),
        "every rank reads its kept tokens from the start of the gathered order: rank 1 gets rank 0's decisions",
    ),
    # One host sync per M2PO call on an accelerator, counted on the CPU (tests/support/host_syncs.py); every dtype.
    Mutation(
        "m2po_k_star_read_on_the_host",
        "trl_async/algorithms/m2po/fast.py",
        "rem_kept = _at(rem, k_star_t)",
        "rem_kept = rem[k_star_t]",
        (M2PO_SYNC_TEST,),
        "the general path indexes with the 0-dim k*: Python reads it with item(), a second host sync",
    ),
    Mutation(
        "m2po_last_k_assigned_from_the_host",
        "trl_async/algorithms/m2po/selection.py",
        "        cond |= kk == c",
        "        cond[-1] = True",
        (M2PO_SYNC_TEST, "tests/test_losses_global.py::test_global_selection_makes_at_most_one_host_sync"),
        "Algorithm 1's last k is assigned as a number: a blocking host-to-device copy in every sorting call",
    ),
    Mutation(
        "authors_cut_read_on_the_host",
        "trl_async/algorithms/m2po/authors_code.py",
        "_at(v, (k_star - 1).clamp(min=0))",
        "v[(k_star - 1).clamp(min=0)]",
        (M2PO_SYNC_TEST,),
        "the authors' cut is indexed with a 0-dim tensor: a second host sync whenever the budget is broken",
    ),
    Mutation(
        "m2po_stats_copied_to_the_device_blocking",
        "trl_async/algorithms/m2po/stats.py",
        "    return vec.to(device, non_blocking=True)",
        "    return vec.to(device)",
        (M2PO_SYNC_TEST,),
        "the stats made from host numbers are uploaded with a blocking copy (a sync; pinned and non_blocking is none)",
    ),
    Mutation(
        "m2po_sign_in_the_advantages_dtype",
        "trl_async/algorithms/m2po/selection.py",
        "advantages.detach().to(device=device, dtype=torch.float32)",
        "advantages.detach().to(device)",
        ("tests/test_dtypes.py",),
        "float64 advantages promote the ranked δ² to float64: m2po_loss on float64 crashes (the H200 check's error)",
    ),
    # A training step's correction and statistics: no host sync of their own (tests/test_step_host_syncs.py).
    Mutation(
        "row_ages_by_bincount",
        "trl_async/algorithms/offpolicy.py",
        "    return counts.index_add_(0, ages, torch.ones_like(ages, dtype=torch.float64))",
        "    return torch.bincount(ages, minlength=max_age + 2).to(torch.float64)",
        (STEP_SYNC_TEST,),
        "row ages counted with bincount, which reads the largest age on the host: a sync per micro-step",
    ),
    Mutation(
        "token_ages_by_boolean_index",
        "trl_async/trainers/engine.py",
        'token_ages = torch.where(mask, self.state.global_step - fields["rollout_token_versions"], 0).double()',
        'token_ages = (self.state.global_step - fields["rollout_token_versions"])[mask].double()',
        (STEP_SYNC_TEST,),
        "token ages selected with a boolean index (nonzero): a sync per micro-step, same sums",
    ),
    Mutation(
        "m2po_all_masked_flag_read_per_micro_batch",
        "trl_async/trainers/engine.py",
        '        self._statistics[mode].add("m2po", stats["sums"].detach().to(torch.float64))\n',
        '        self._statistics[mode].add("m2po", stats["sums"].detach().to(torch.float64))\n'
        '        if stats["sums"][-1] > 0:\n            logger.warning("M2PO masked every token of a micro-batch")\n',
        (STEP_SYNC_TEST,),
        "the all-masked flag is read per micro-batch to warn: a second sync in every M2PO micro-step",
    ),
    Mutation(
        "m2po_all_masked_warning_dropped",
        "trl_async/trainers/statistics.py",
        "    if all_masked:\n        logger.warning(",
        "    if False:\n        logger.warning(",
        ("tests/test_step_host_syncs.py::test_a_micro_batch_m2po_masked_whole_is_warned_about_at_log_time",),
        "a micro-batch M2PO masked whole is counted but never warned about",
    ),
    Mutation(
        "window_numbers_copied_blocking",
        "trl_async/trainers/statistics.py",
        "    return host.to(device, non_blocking=True)",
        "    return host.to(device)",
        ("tests/test_step_host_syncs.py::test_a_logging_step_reads_the_window_once",),
        "host numbers reach the statistics window by a blocking copy: a sync for each",
    ),
    # The counter itself must be able to fail.
    Mutation(
        "sync_counter_blind_to_nonzero",
        "tests/support/host_syncs.py",
        '    aten.nonzero.default: "nonzero (its output size depends on the data)",\n',
        "",
        ("tests/test_host_syncs.py",),
        "the counter misses nonzero (torch.where(c), argwhere)",
    ),
    Mutation(
        "sync_counter_takes_everything_for_host_data",
        "tests/support/host_syncs.py",
        "    if first is not None and counter.is_host(first) and func is not aten.copy_.default",
        "    if first is not None and func is not aten.copy_.default",
        ("tests/test_host_syncs.py",),
        "the counter treats every tensor as host memory: reads of device data count as free",
    ),
    # --------------------------------------------------------------------------------------- PPO
    Mutation(
        "gae_lambda_dropped",
        "trl_async/algorithms/ppo.py",
        "running = deltas[..., t] + (gamma * lam) * running",
        "running = deltas[..., t] + gamma * running",
        ("tests/test_ppo_math.py",),
        "GAE ignores λ (Monte-Carlo advantages)",
    ),
    Mutation(
        "ppo_value_clip_around_new_values",
        "trl_async/trainers/ppo.py",
        'critic = value_loss(values, inputs["old_values"], inputs["returns"], mask, args.cliprange_value, normalizer)',
        'critic = value_loss(values, values, inputs["returns"], mask, args.cliprange_value, normalizer)',
        (PPO_STALE_TEST,),
        "the value clip is taken around the critic's values at loss time, not V_old: it never binds on a reused batch",
    ),
    Mutation(
        "ppo_importance_weight_dropped",
        "trl_async/trainers/ppo.py",
        "weights = self._behaviour_correction(output, old_logps, mask=mask).weights",
        "self._behaviour_correction(output, old_logps, mask=mask)",
        (PPO_STALE_TEST,),
        "PPO trains on stale rows without the truncated importance weight π_old/μ",
    ),
    Mutation(
        "ppo_importance_weight_against_current_policy",
        "trl_async/trainers/ppo.py",
        "weights = self._behaviour_correction(output, old_logps, mask=mask).weights",
        "weights = self._behaviour_correction(output, output['sampling_per_token_logps'], mask=mask).weights",
        (PPO_STALE_TEST,),
        "the importance weight is μ/μ = 1 (π_old taken from the wrong tensor) on a batch reused across steps",
    ),
    Mutation(
        "ppo_advantages_whitened_without_centring",
        "trl_async/algorithms/ppo.py",
        "advantages = masked_whiten(advantages, mask, shift_mean=True)",
        "advantages = masked_whiten(advantages, mask, shift_mean=False)",
        (PPO_STALE_TEST,),
        "advantages are scaled to unit variance but keep their mean (the reward whitening's setting)",
    ),
    Mutation(
        "ppo_old_logps_from_the_loss_forward",
        "trl_async/trainers/ppo.py",
        'per_token_logps,\n                inputs["old_per_token_logps"],\n                inputs["advantages"],',
        'per_token_logps,\n                per_token_logps.detach(),\n                inputs["advantages"],',
        (PPO_STALE_TEST,),
        "π_old is taken from the loss's own forward: the ratio is 1 and PPO's clip never acts on a reused batch",
    ),
    Mutation(
        "ppo_value_head_left_random",
        "trl_async/trainers/critic.py",
        "            nn.init.zeros_(value_model.score.weight)",
        "            pass",
        (
            "tests/test_ppo_trainer.py::test_trains_policy_and_critic_and_logs_ppo_metrics",
            "tests/test_recipe.py::test_ppo_config_runs_ppo_with_its_card_and_metrics",
        ),
        "the critic built from a causal-LM checkpoint keeps a random value head: the first advantages are its noise",
    ),
    # --------------------------------------------------------------------------------------- recipe
    Mutation(
        "recipe_eval_ignores_eval_max_new_tokens",
        "recipes/qwen_math.py",
        "max_new_tokens=recipe.eval_max_new_tokens or training_args.max_completion_length,",
        "max_new_tokens=training_args.max_completion_length,",
        ("tests/test_recipe.py::test_synchronous_baseline_runs_from_the_same_config",),
        "the held-out evaluation generates max_completion_length tokens whatever eval_max_new_tokens says",
    ),
    # --------------------------------------------------------------------------------------- speed, same numbers
    Mutation(
        "shared_prompt_segments_see_each_other",
        "trl_async/trainers/forward.py",
        "same_or_shared = (segment.unsqueeze(2) == segment.unsqueeze(1)) | (segment.unsqueeze(1) == -1)",
        "same_or_shared = torch.ones_like(segment.unsqueeze(2) == segment.unsqueeze(1))",
        ("tests/test_shared_prompt.py",),
        "a packed completion attends to the other completions of its group: log-probs no longer TRL's",
    ),
    Mutation(
        "shared_prompt_positions_restart",
        "trl_async/trainers/forward.py",
        "positions[rows, columns] = (P - 1 + offsets).expand(num_rows, -1)[kept]",
        "positions[rows, columns] = offsets.expand(num_rows, -1)[kept]",
        ("tests/test_shared_prompt.py",),
        "packed completions get positions counted from their segment, not from their row",
    ),
    Mutation(
        "shared_prompt_unpacks_past_the_row",
        "trl_async/trainers/forward.py",
        "return values.masked_fill(~in_segment, 0)",
        "return values",
        ("tests/test_shared_prompt.py",),
        "past a row's last real token, unpack returns the next segment's values instead of TRL's masked zeros",
    ),
    Mutation(
        "prompt_prefix_read_by_the_wrong_rows",
        "trl_async/trainers/forward.py",
        "keys = torch.cat([self.keys[layer_idx][self.row_group], key_states], dim=-2)",
        "keys = torch.cat([self.keys[layer_idx][self.row_group.flip(0)], key_states], dim=-2)",
        ("tests/test_shared_prompt.py",),
        "long completions attend to another group's prompt keys",
    ),
    Mutation(
        "prompt_prefix_attends_prompt_padding",
        "trl_async/trainers/forward.py",
        "shared = prefix_valid[row_group].unsqueeze(1).expand(-1, 1 + L, -1)",
        "shared = torch.ones_like(prefix_valid)[row_group].unsqueeze(1).expand(-1, 1 + L, -1)",
        ("tests/test_shared_prompt.py",),
        "completions attend to their prompt's left padding through the prefix",
    ),
    Mutation(
        "prompt_prefix_under_reentrant_checkpointing",
        "trl_async/trainers/forward.py",
        'if settings.get("use_reentrant", True) is not False:',
        "if False:",
        ("tests/test_shared_prompt.py",),
        "the prefix is used where reentrant checkpointing cuts it from the graph (the prompt loses its gradient)",
    ),
    Mutation(
        "prefill_cache_given_to_the_wrong_rows",
        "trl_async/rollout/backends/hf.py",
        "cache.batch_select_indices(row_to_prompt)",
        "cache.batch_select_indices(row_to_prompt.flip(0))",
        ("tests/test_backends.py",),
        "each row continues another prompt's prefilled cache",
    ),
    Mutation(
        "policy_recorder_shared_under_warpers",
        "trl_async/rollout/backends/hf.py",
        "if not processors and policy_recorder.temperature == 1.0:",
        "if policy_recorder.temperature == 1.0:",
        ("tests/test_backends.py",),
        "the trainer-parametrization μ is taken from the warped scores when top-k/top-p/min-p are set",
    ),
    Mutation(
        "lending_ignores_the_other_side",
        "trl_async/rollout/cores.py",
        "return self.cores if self._waiting[1 - side] else self.shares[side]",
        "return self.cores if self._waiting[side] else self.shares[side]",
        ("tests/test_cores.py",),
        "a process takes every core when it waits itself, not when the other one does",
    ),
    Mutation(
        "lending_misses_the_backward",
        "trl_async/rollout/cores.py",
        "tensor.register_hook(before_backward)",
        "tensor.register_hook(lambda grad: None)",
        ("tests/test_cores.py::test_the_trainer_computes_on_every_core_exactly_while_the_generator_waits",),
        "the backward runs on the thread count the forward left, whatever the generator does meanwhile",
    ),
    # --------------------------------------------------------------------------------------- TRL contract
    Mutation(
        "hook_slot_outlives_its_call",
        "trl_async/trainers/engine.py",
        "        finally:\n            self._hook_slot = None",
        "        finally:\n            pass",
        ("tests/test_trl_contract.py::test_the_hook_slot_lives_for_one_trl_call_only",),
        "the rollout batch stays in the hook slot after TRL's call: a later synchronous call would serve it again",
    ),
    Mutation(
        "generate_fields_out_of_trls_order",
        "trl_async/trl_contract.py",
        '    "completions",\n    "logprobs",',
        '    "logprobs",\n    "completions",',
        ("tests/test_trl_contract.py::test_generate_returns_the_fields_in_the_contracts_order",),
        "the rollout's completions reach TRL where it reads the behaviour log-probs, and the other way round",
    ),
    Mutation(
        "policy_logps_never_reach_the_correction",
        "trl_async/trainers/engine.py",
        "            self._correct_at_forward(batch, outputs[0].detach())",
        "            pass",
        ("tests/test_importance_trainer.py",),
        "the importance weight is never folded in: TRL's losses train on stale rows uncorrected",
    ),
    Mutation(
        "ppo_config_skips_trls_clip_check",
        "trl_async/trl_contract.py",
        "    if low is not None and high is not None and low >= high:",
        "    if False:",
        ("tests/test_trl_contract.py::test_finish_grpo_config_is_grpo_configs_post_init",),
        "AsyncPPOConfig's copy of GRPOConfig's post-init drifts from TRL's: a clip range TRL refuses is accepted",
    ),
    # --------------------------------------------------------------------------------------- in-flight updates
    Mutation(
        "inflight_version_recorded_after_the_update",
        "trl_async/rollout/backends/hf.py",
        """            step_versions.append(self.version)  # the weights that computed this step's scores, hence its token
            if self.inflight_weight_updates:""",
        """            if self.inflight_weight_updates:
                self.update_weights()
            step_versions.append(self.version)
            if self.inflight_weight_updates:""",
        (
            "tests/test_inflight.py::test_a_forced_mid_sequence_update_changes_the_distribution_exactly_at_the_recorded_token",
        ),
        "a token is tagged with the weights loaded after its step, one step early at every switch",
    ),
    Mutation(
        "inflight_updates_never_load",
        "trl_async/rollout/backends/hf.py",
        "            if self.inflight_weight_updates:\n",
        "            if False:\n",
        ("tests/test_inflight.py",),
        "inflight_weight_updates=True decodes a whole batch on its first weights",
    ),
    Mutation(
        "inflight_batch_tagged_with_its_newest_token",
        "trl_async/rollout/payload.py",
        "return min(firsts) if firsts else None",
        "return max(max(v) for v in self.token_versions if v) if firsts else None",
        ("tests/test_inflight.py::test_every_token_of_a_training_batch_records_the_weights_that_sampled_it",),
        "a batch's staleness is its newest token's: rows with older tokens pass the bound",
    ),
    Mutation(
        "inflight_batch_not_gated",
        "trl_async/rollout/generator.py",
        """    def ready():
        waited = recorder.begin()
        _wait_for_weights(trainable_store, min_version, beat_or_stop, on_idle)""",
        """    def ready():
        waited = recorder.begin()""",
        (
            "tests/test_inflight.py::test_a_generator_ahead_of_the_trainer_waits_for_recent_weights_before_a_batch_starts",
        ),
        "in-flight batches start on whatever weights are loaded: batches too old to train on are made, then evicted",
    ),
    # --------------------------------------------------------------------------------------- staleness study
    Mutation(
        "fixed_staleness_not_held_back",
        "trl_async/rollout/pipeline.py",
        "        if self.settings.fixed_staleness:\n",
        "        if False:\n",
        ("tests/test_fixed_staleness.py::test_every_row_is_exactly_k_versions_old_at_its_last_use",),
        "fixed_staleness publishes every version at once: the generator samples with newer weights than k versions old",
    ),
    Mutation(
        "offpolicy_ess_unnormalized",
        "trl_async/algorithms/offpolicy.py",
        "ess = torch.where(has, weight_sum.square() / (tokens * weight_sq_sum).clamp(min=1e-300), 0.0)",
        "ess = torch.where(has, weight_sum / tokens, 0.0)",
        ("tests/test_offpolicy.py",),
        "offpolicy/ess is the mean weight, not the effective sample size",
    ),
    Mutation(
        "offpolicy_after_ignores_the_treatment",
        "trl_async/algorithms/offpolicy.py",
        "torch.where(kept, after.square(), 0.0).sum(),",
        "torch.where(valid, delta.square(), 0.0).sum(),",
        ("tests/test_offpolicy.py",),
        "E[δ²] after masking or clipping is the same as before: the diagnostic cannot show what the loss removed",
    ),
    Mutation(
        "offpolicy_after_over_every_token",
        "trl_async/algorithms/offpolicy.py",
        'out["offpolicy/delta_sq_after"] = s["delta_sq_kept"] / kept if kept else 0.0',
        'out["offpolicy/delta_sq_after"] = s["delta_sq_kept"] / tokens if kept else 0.0',
        (
            "tests/test_offpolicy.py::test_delta_sq_after_is_the_mean_over_the_tokens_kept_after_masking_and_clipping",
            "tests/test_offpolicy.py::"
            "test_delta_sq_after_in_a_token_mask_run_is_the_mean_over_the_tokens_the_mask_kept",
        ),
        "E[δ'²] divided by every valid token instead of the kept ones: masked tokens pull the figure toward zero",
    ),
    Mutation(
        "row_age_from_the_wrong_version",
        "trl_async/trainers/engine.py",
        'row_age_counts(self.state.global_step - fields["rollout_versions"], max_age)',
        'row_age_counts(self.state.global_step - fields["rollout_versions"] - 1, max_age)',
        ("tests/test_offpolicy.py::test_offpolicy_metrics_in_a_run_equal_a_recomputation_and_move_with_staleness",),
        "row ages counted one version short of the weights that generated the rows",
    ),
    Mutation(
        "lent_share_counts_the_whole_run",
        "trl_async/rollout/pipeline.py",
        "lent_calls = self._lending.lent_calls - self._lending_counts[1]",
        "lent_calls = self._lending.lent_calls",
        ("tests/test_cores.py::test_async_training_lends_cores_and_restores_the_thread_count",),
        "the logged share of layer passes on every core counts the lent passes of the whole run, not of the window",
    ),
    Mutation(
        "switch_repeats_a_batch",
        "trl_async/rollout/pipeline.py",
        "start = self._next_index + (1 if self._making_batch else 0)",
        "start = self._next_index",
        ("tests/test_engine.py::test_a_generator_ready_while_the_trainer_makes_a_batch_takes_over_one_batch_later",),
        "at the start-up switch the generation process makes the batch the trainer is making (trained twice)",
    ),
    # --------------------------------------------------------------------------------------- benchmarks/RESULTS.md
    Mutation(
        "results_ratio_inverted",
        "benchmarks/render_results.py",
        'return [p["sync"]["train_seconds"] / p["async"]["train_seconds"] for p in main_job_pairs(data)]',
        'return [p["async"]["train_seconds"] / p["sync"]["train_seconds"] for p in main_job_pairs(data)]',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the main job's headline ratio is async/sync: a speed-up reads as a slow-down",
    ),
    Mutation(
        "results_inflight_ratio_inverted",
        "benchmarks/render_results.py",
        'e2e = [g["train_s"] / f["train_s"] for g, f in zip(gate, inflight, strict=True)]',
        'e2e = [f["train_s"] / g["train_s"] for g, f in zip(gate, inflight, strict=True)]',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "in-flight against the gate-only engine read the wrong way round: a slow-down reads as issue 24's speed-up",
    ),
    Mutation(
        "results_std_as_standard_error",
        "benchmarks/render_results.py",
        "return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))",
        "return statistics.mean(values), statistics.stdev(values)",
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "± printed as the standard deviation while RESULTS.md says standard error",
    ),
    Mutation(
        "results_trl_compat_counts_stock",
        "benchmarks/render_results.py",
        'kept = [name for name in stock if outcome(tests[name], "swapped") == "passed"]',
        'kept = [name for name in stock if outcome(tests[name], "stock") == "passed"]',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "TRL's tests that fail with the class swapped are counted as kept",
    ),
    Mutation(
        "real_size_clock_starts_before_the_generators_first_batch",
        "benchmarks/render_results.py",
        'enumerate(run.get("batch_source") or []) if source == "generator"), None)',
        'enumerate(run.get("batch_source") or []) if source is not None), None)',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the real-size steady state starts after the trainer's own first batch, before the generation process's first "
        "one: start-up steps counted as steady state",
    ),
    Mutation(
        "real_size_ratio_inverted",
        "benchmarks/render_results.py",
        "steady.append(real_size_steady(other, first, block)[0] / mine)",
        "steady.append(mine / real_size_steady(other, first, block)[0])",
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the real-size steady-state ratio is async / TRL: a speed-up reads as a slow-down",
    ),
    Mutation(
        "real_size_other_arms_measured_from_their_first_step",
        "benchmarks/render_results.py",
        "steady.append(real_size_steady(other, first, block)[0] / mine)",
        "steady.append(real_size_steady(other, 0, block)[0] / mine)",
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the arms compared with the asynchronous run are measured over all their steps, start-up included, not over "
        "the same steps as it",
    ),
    Mutation(
        "real_size_startup_phase_read_as_time_since_spawn",
        "benchmarks/render_results.py",
        '        elapsed += phase["seconds"]',
        '        elapsed = phase["seconds"]',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the generation process's 'ready after spawn' is the last phase alone (model built -> ready), not the time "
        "since spawn",
    ),
    Mutation(
        "real_size_ready_without_the_time_before_the_spawn",
        "benchmarks/render_results.py",
        '    return spawned + startup["ready"]',
        '    return startup["ready"]',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the generation process's readiness after training began leaves out what the trainer did before spawning it",
    ),
    Mutation(
        "docs_style_seeds_difference_reversed",
        "benchmarks/render_results.py",
        'return [p["async"]["held_out_accuracy"] - p["trl"]["held_out_accuracy"] for p in docs_style_pairs(data)]',
        'return [p["trl"]["held_out_accuracy"] - p["async"]["held_out_accuracy"] for p in docs_style_pairs(data)]',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the docs-style seeds study reports TRL − async: a loss of accuracy reads as a gain",
    ),
    Mutation(
        "seeds_interval_with_n_degrees_of_freedom",
        "benchmarks/render_results.py",
        "    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96\n",
        "    t = _T975[n - 1] if n <= len(_T975) else 1.96\n",
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the seeds' 95% interval takes Student's t at n degrees of freedom instead of n - 1: too narrow",
    ),
    Mutation(
        "main_job_unkept_steps_placed_at_the_next_kept_one",
        "benchmarks/bench_main_job.py",
        "out.append(t1 if s1 == step else t0 + (t1 - t0) * (step - s0) / (s1 - s0))",
        "out.append(t1)",
        ("tests/test_run_all.py::test_the_main_job_places_the_steps_its_timeline_did_not_keep_between_the_kept_ones",),
        "the reward-against-time picture puts the steps the timeline did not keep at the next kept step's end",
    ),
    Mutation(
        "results_readme_table_dropped",
        "benchmarks/run_all.py",
        'f.write(head + README_START + "\\n" + table + "\\n" + README_END + tail)',
        'f.write(head + README_START + "\\n" + README_END + tail)',
        ("tests/test_run_all.py::test_render_only_rewrites_only_the_readme_table",),
        "README's results table is emptied instead of regenerated",
    ),
    Mutation(
        "results_missing_earlier_file_unnamed",
        "benchmarks/run_all.py",
        "        if missing:\n            raise FileNotFoundError(",
        "        if False:\n            raise FileNotFoundError(",
        ("tests/test_run_all.py::test_a_missing_results_file_is_never_rendered_silently",),
        "a missing results file is read as nothing instead of an error that names it",
    ),
    Mutation(
        "main_reward_pickled_by_name",
        "trl_async/rewards/base.py",
        "            and _importable_by_name(module.__name__)\n",
        "",
        (
            "tests/test_main_module_rewards.py::test_decorated_rewards_from_main_unpickle_in_a_process_that_never_ran_main",
            "tests/test_main_module_rewards.py::test_rewards_defined_in_a_script_train_with_python_script_py",
        ),
        "a @tensor_reward function of the user's __main__ is pickled by name: the generation process cannot load it",
    ),
    Mutation(
        "spawned_script_rewards_pickled_by_name",
        "trl_async/rollout/generator.py",
        '    is_script = getattr(script, "__name__", None) == "__mp_main__"\n',
        "    is_script = False\n",
        (
            "tests/test_main_module_rewards.py::"
            "test_rewards_defined_in_a_script_train_in_a_torch_multiprocessing_spawn_worker",
        ),
        "rewards of a script run as __mp_main__ (a spawned worker) go by name: the generation process cannot load them",
    ),
    Mutation(
        "infinite_reward_accepted",
        "trl_async/rewards/runner.py",
        "if infinite.any():",
        "if False:",
        bad_input("tensor_reward_inf", "tensor_reward_negative_inf", "text_reward_inf"),
        "a reward of ±inf is trained on (logged as ±inf while the loss is 0) instead of refused",
    ),
    Mutation(
        "raising_reward_not_named",
        "trl_async/rewards/runner.py",
        "    except Exception as error:\n        note = ",
        "    except Exception as error:\n        raise\n        note = ",
        bad_input("text_reward_raises", "text_reward_raises_in_generation_process"),
        "a reward function that raises surfaces as its bare exception, without its name or what to do",
    ),
    Mutation(
        "generator_error_starts_with_the_traceback",
        "trl_async/rollout/generator.py",
        '            raise GeneratorError(\n                f"{summary}\\n(raised in the generation process of {self.rank}, pid {self.pid})\\n{details}"\n            )',
        '            raise GeneratorError(f"The generation process of {self.rank} (pid {self.pid}) failed:\\n{error}")',
        bad_input("text_reward_raises_in_generation_process", "tensor_reward_wrong_shape_in_generation_process"),
        "an error of the generation process reaches the user as a traceback whose first line says nothing",
    ),
    Mutation(
        "prompt_past_the_context_accepted",
        "trl_async/rollout/prompts.py",
        "if context is not None and len(ids) >= context:",
        "if False:",
        bad_input("prompt_longer_than_context", "prompt_longer_than_context_streamed"),
        "a prompt longer than the model's context is generated from silently",
    ),
    Mutation(
        "empty_prompt_accepted",
        "trl_async/rollout/prompts.py",
        'return "is an empty string" if not prompt else None',
        "return None",
        bad_input("empty_prompt", "empty_prompt_streamed_generation_process"),
        "an empty prompt fails late with an IndexError deep in generation",
    ),
    Mutation(
        "prompt_column_not_checked",
        "trl_async/config/inputs.py",
        'if columns is not None and "prompt" not in columns and prompt_required:',
        "if False:",
        bad_input("no_prompt_column"),
        "a dataset without a prompt column fails at the first batch with KeyError: 'prompt'",
    ),
    Mutation(
        "too_few_prompts_accepted",
        "trl_async/config/inputs.py",
        "if rows < needed:",
        "if False:",
        bad_input("too_few_prompts"),
        "a dataset smaller than one generation batch trains no step, silently",
    ),
    Mutation(
        "reward_columns_not_checked",
        "trl_async/config/inputs.py",
        "        if missing:\n            hint",
        "        if False:\n            hint",
        bad_input("text_reward_missing_column", "math_answer_reward_missing_column", "tensor_reward_missing_column"),
        "a reward needing a column the dataset lacks fails at the first batch, in the generation process",
    ),
    Mutation(
        "generation_device_not_checked",
        "trl_async/config/inputs.py",
        'check_generation_device(getattr(args, "generation_device", None))',
        "pass",
        bad_input("generation_device_unknown", "generation_device_absent"),
        "an unknown or absent generation_device fails late, in the generation process only",
    ),
    Mutation(
        "tokenizer_eos_not_checked",
        "trl_async/config/inputs.py",
        "check_eos_and_pad(trainer.processing_class)",
        "pass",
        bad_input("tokenizer_without_eos_or_pad"),
        "a tokenizer without EOS fails at the first batch with a TypeError",
    ),
    Mutation(
        "model_id_not_named",
        "trl_async/config/inputs.py",
        "except OSError as error:  # not found, not reachable, gated",
        "except ImportError as error:  # not found, not reachable, gated",
        bad_input("model_id_offline", "reward_model_id_offline"),
        "a model that cannot be loaded offline fails with transformers' message, which never names the id",
    ),
    Mutation(
        "corrupt_rollout_state_not_named",
        "trl_async/trainers/checkpoints.py",
        "except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:",
        "except (OSError, UnicodeDecodeError) as error:",
        bad_input("resume_corrupt_rollout_state"),
        "a corrupt trl_async_rollout.json fails with a bare JSONDecodeError that names no file",
    ),
    Mutation(
        "resume_other_run_accepted",
        "trl_async/trainers/checkpoints.py",
        'saved = (ranks[0].get("run") if ranks else None) or None',
        "saved = None",
        bad_input("resume_run_with_other_settings"),
        "a checkpoint of a run with another batch geometry resumes at a stream position that means other rows",
    ),
    Mutation(
        "spool_janitor_removes_nothing",
        "trl_async/rollout/janitor.py",
        "    shutil.rmtree(path, ignore_errors=True)\n",
        "    pass\n",
        ("tests/test_faults.py::test_sigkill_of_the_trainer_leaves_no_process_and_nothing_in_dev_shm",),
        "a trainer killed with SIGKILL leaves its spool in /dev/shm",
    ),
    Mutation(
        "spool_janitor_in_the_trainers_process_group",
        "trl_async/rollout/janitor.py",
        "                start_new_session=True,\n",
        "",
        (
            "tests/test_faults.py::"
            "test_sigkill_of_the_trainers_whole_process_group_leaves_no_process_and_nothing_in_dev_shm",
        ),
        "the janitor stays in the trainer's process group: `kill -9 -PGID` kills it too and the spool stays in /dev/shm",
    ),
    Mutation(
        "generator_waits_for_its_dead_trainer_to_be_reaped",
        "trl_async/rollout/generator.py",
        "        return _is_zombie(parent_pid)\n",
        "        return False\n",
        ("tests/test_faults.py::test_sigkill_of_the_trainer_leaves_no_process_and_nothing_in_dev_shm",),
        "a generation process outlives its killed trainer while the trainer's parent reads their shared output",
        # The guard passes in ~25 s on the real code. The mutant deadlocks (the parent waits for output the generation
        # process holds open) until the guard's own 300 s timeout; 90 s tells the same.
        timeout=90.0,
    ),
    Mutation(
        "sigterm_kills_at_once",
        "trl_async/rollout/termination.py",
        "signal.signal(signal.SIGTERM, handler)",
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)",
        ("tests/test_faults.py::test_sigterm_during_a_save_keeps_the_previous_checkpoint_with_save_total_limit_1",),
        "SIGTERM kills the trainer at once: no cleanup, no exit message, the generation process left to die with it",
    ),
    Mutation(
        "ctrl_c_ignored_during_a_save",
        "trl_async/trainers/engine.py",
        "            try:\n                super()._save_checkpoint(model, trial)\n            finally:\n"
        "                self.args.save_total_limit = limit\n",
        "            sigint = __import__('signal').signal(2, __import__('signal').SIG_IGN)\n"
        "            try:\n                super()._save_checkpoint(model, trial)\n            finally:\n"
        "                self.args.save_total_limit = limit\n                __import__('signal').signal(2, sigint)\n",
        ("tests/test_faults.py::test_ctrl_c_while_the_weights_are_written",),
        "a Ctrl-C during a save is dropped (SIGINT ignored so that the checkpoint is not cut short): the run goes on, "
        "saves and exits 0 as if it had finished",
    ),
    Mutation(
        "ctrl_c_during_a_save_reported_as_a_failed_write",
        "trl_async/trainers/checkpoints.py",
        "    except Exception as error:\n        previous = last_complete_checkpoint(run_dir)",
        "    except BaseException as error:\n        previous = last_complete_checkpoint(run_dir)",
        ("tests/test_faults.py::test_ctrl_c_while_the_weights_are_written",),
        "a Ctrl-C during a save ends the run as a CheckpointSaveError (exit 1, 'free space'), not as a Ctrl-C",
    ),
    Mutation(
        "partial_checkpoint_counts_as_complete",
        "trl_async/trainers/checkpoints.py",
        "return os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE)) and not os.path.lexists(incomplete_marker(folder))",
        "return os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE))",
        (
            "tests/test_faults.py::test_sigterm_during_a_save_keeps_the_previous_checkpoint_with_save_total_limit_1",
            "tests/test_faults.py::test_a_checkpoint_is_complete_with_its_trainer_state_and_without_a_marker",
        ),
        "a checkpoint whose save was interrupted after Trainer's last file is taken for a complete one",
    ),
    Mutation(
        "rotation_before_the_checkpoint_is_complete",
        "trl_async/trainers/engine.py",
        "self.args.save_total_limit = None  # Trainer's rotation",
        "self.args.save_total_limit = limit  # Trainer's rotation",
        ("tests/test_faults.py::test_sigterm_during_a_save_keeps_the_previous_checkpoint_with_save_total_limit_1",),
        "save_total_limit deletes the previous complete checkpoint before the new one is complete",
    ),
    Mutation(
        "resume_true_takes_the_newest_folder",
        "trl_async/trainers/engine.py",
        "resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)",
        "resume_from_checkpoint = True",
        (
            "tests/test_faults.py::test_train_refuses_a_partial_checkpoint_and_resumes_true_only_from_a_complete_one",
            "tests/test_faults.py::test_sigterm_during_a_save_keeps_the_previous_checkpoint_with_save_total_limit_1",
        ),
        "resume_from_checkpoint=True resumes from transformers' newest folder, a partial checkpoint included",
    ),
    Mutation(
        "partial_checkpoint_path_accepted",
        "trl_async/trainers/engine.py",
        "            check_resumable(resume_from_checkpoint)\n",
        "            pass\n",
        ("tests/test_faults.py::test_train_refuses_a_partial_checkpoint_and_resumes_true_only_from_a_complete_one",),
        "an explicit path to a partial checkpoint is resumed from",
    ),
    Mutation(
        "failed_checkpoint_write_unnamed",
        "trl_async/trainers/checkpoints.py",
        "    except Exception as error:\n        previous = last_complete_checkpoint(run_dir)",
        "    except ZeroDivisionError as error:\n        previous = last_complete_checkpoint(run_dir)",
        (
            "tests/test_faults.py::test_a_file_size_limit_at_checkpoint_time_names_the_folder_and_keeps_the_previous_one",
        ),
        "a write error at checkpoint time surfaces as torch's or safetensors' message, which names no file",
    ),
    Mutation(
        "generator_error_without_rank",
        "trl_async/rollout/generator.py",
        'return f"rank {self.spec.process_index}"',
        'return "this rank"',
        ("tests/test_rank_failures.py::test_a_reward_that_raises_on_rank_1_ends_both_ranks",),
        "with several ranks, a generation process's error does not say which rank failed",
    ),
    Mutation(
        "generator_threads_added_to_the_budget",
        "trl_async/rollout/placement.py",
        "trainer_threads = max(1, budget - threads)",
        "trainer_threads = budget",
        (
            "tests/test_cores.py::test_the_generator_and_the_trainer_split_the_budget",
            "tests/test_cores.py::test_the_generation_process_and_the_trainer_share_omp_num_threads",
        ),
        "the trainer keeps the whole thread budget and the generator's threads come on top (oversubscription)",
    ),
    Mutation(
        "budget_ignores_omp_num_threads",
        "trl_async/rollout/placement.py",
        "if omp.isdigit() and int(omp) >= 1:",
        "if False:",
        (
            "tests/test_cores.py::test_the_thread_budget_comes_from_omp_then_an_explicit_torch_count_then_the_cores",
            "tests/test_cores.py::test_the_generation_process_and_the_trainer_share_omp_num_threads",
        ),
        "the user's OMP_NUM_THREADS is not the budget: the rank's cores are split instead",
    ),
    Mutation(
        "budget_of_one_not_logged",
        "trl_async/trainers/rollout_spec.py",
        "        logger.warning(where.note)\n",
        "        pass\n",
        ("tests/test_cores.py::test_the_generation_process_and_the_trainer_share_omp_num_threads",),
        "a thread budget of 1 is silently exceeded: nothing tells the user what runs where",
    ),
    Mutation(
        "spool_items_never_removed",
        "trl_async/rollout/queue.py",
        "            item = pickle.load(f)\n        os.unlink(path)\n",
        "            item = pickle.load(f)\n",
        ("tests/test_soak.py",),
        "every consumed batch stays in /dev/shm: the spool grows for the whole run",
    ),
    Mutation(
        "vespo_weight_folded_into_the_advantages",
        "trl_async/trainers/correction.py",
        'if loss_type == "vespo":',
        'if loss_type == "no such loss":',
        ("tests/test_importance_trainer.py",),
        "VESPO's weight multiplies the advantages instead of entering φ as TRL's importance_sampling_ratio",
    ),
    Mutation(
        "weight_store_sends_a_buffer_per_tensor",
        "trl_async/rollout/weights.py",
        "name: self._flat[dtype][offset : offset + math.prod(shape)].view(shape)",
        "name: self._flat[dtype][offset : offset + math.prod(shape)].view(shape).clone().share_memory_()",
        ("tests/test_weights.py::test_a_store_of_hundreds_of_tensors_reaches_a_fork_server_child",),
        "the store pickles every tensor's view: a fork server refuses the >256 file descriptors of a 0.5B model's base",
    ),
    # --------------------------------------------------------------------------------------- several processes
    Mutation(
        "start_up_batch_skips_the_eviction_agreement",
        "trl_async/rollout/pipeline.py",
        "staleness = self._agree(batch.staleness)",
        "staleness = batch.staleness",
        (f"{DIVERGING_TEST}[late_generator]",),
        "a rank on a batch its trainer made skips the all-gather that a rank on a generator batch joins",
        timeout=600,
    ),
    Mutation(
        "eviction_agreement_ignored",
        "trl_async/rollout/queue.py",
        "staleness = local if agree is None else agree(local)",
        "staleness = local if agree is None else (agree(local), local)[1]",
        ("tests/test_diverging_ranks.py::test_an_item_too_old_on_one_rank_only_is_evicted_on_both",),
        "the ranks agree on the staleness but each evicts by its own: an item too old on one rank is trained on the other",
        timeout=600,
    ),
    Mutation(
        "tokens_seen_counted_only_for_generator_batches",
        "trl_async/trainers/engine.py",
        "        self._log_completion_lengths(payload)\n",
        "        if not slot.batch.from_trainer:\n            self._log_completion_lengths(payload)\n",
        (f"{DIVERGING_TEST}[late_generator]",),
        "a collective joined only by ranks whose batch came from the generation process (the wave-4 crash's pattern)",
        timeout=600,
    ),
    Mutation(
        "collective_check_never_compares",
        "trl_async/trainers/collectives.py",
        "if not bool((gathered == gathered[0]).all()):",
        "if False:",
        ("tests/test_diverging_ranks.py::test_the_collective_check_names_both_ranks_calls_on_a_mismatch",),
        "the collective check fingerprints every call but never compares the ranks' fingerprints",
    ),
    # --------------------------------------------------------------------------------------- review findings, issue 40
    Mutation(
        "tool_loop_contract_error_caught_by_trl",
        "trl_async/rollout/tool_calls.py",
        "class ToolLoopContractError(BaseException):",
        "class ToolLoopContractError(RuntimeError):",
        (
            "tests/test_trl_contract.py::test_a_call_trls_tool_loop_makes_out_of_the_first_rounds_order_stops_the_batch",
        ),
        "the first round's contract check raises an Exception inside the tool call: TRL's loop turns it into the "
        "tool's error result and training goes on with results paired with the wrong calls",
    ),
    Mutation(
        "resume_check_reads_the_newest_folder",
        "trl_async/trainers/checkpoints.py",
        "        return last_complete_checkpoint(output_dir)\n",
        "        from transformers.trainer_utils import get_last_checkpoint\n\n"
        "        return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None\n",
        ("tests/test_faults.py::test_the_checkpoint_checked_before_resume_true_is_the_newest_complete_one",),
        "resume_checkpoint_dir(True) takes transformers' newest folder, a partial checkpoint included, against the "
        "module's one rule for a complete checkpoint",
    ),
    Mutation(
        "collective_check_reads_the_group_by_name_only",
        "trl_async/trainers/collectives.py",
        '                    group = arguments.get("group")\n',
        '                    group = kwargs.get("group")\n',
        ("tests/test_diverging_ranks.py::test_a_sub_group_passed_by_position_is_checked_within_that_group",),
        "a sub-group passed by position (`dist.barrier(pg)`) is fingerprinted over the whole world: the ranks outside "
        "it are paired with it (a false mismatch, or a hang)",
    ),
    Mutation(
        "collective_fingerprint_without_the_shape",
        "trl_async/trainers/collectives.py",
        "            fingerprint[4] = _stable_hash(str(call.shape))  # every dimension: sizes, rank and order\n",
        "",
        (
            "tests/test_diverging_ranks.py::test_the_same_call_with_another_shape_on_each_rank_is_named_with_both_shapes",
        ),
        "the same call site with a tensor of another size on each rank passes the check: gloo aborts (or reduces "
        "misaligned data) far from the call",
    ),
    # --------------------------------------------------------------------------------------- end of issue 40's block
    Mutation(
        "help_percent_unescaped",
        "trl_async/config/grpo.py",
        "saves under 20%% of the tokens",
        "saves under 20% of the tokens",
        ("tests/test_config_help.py",),
        "a bare '%' in a config field's help: `--help` of every TrlParser script crashes",
    ),
    Mutation(
        "multinode_help_needs_servers",
        "recipes/accelerate_configs/multinode_grpo.py",
        '    if {"-h", "--help"} & set(sys.argv[1:]):',
        "    if False:",
        (
            "tests/test_entry_points.py::test_help_exits_0_and_names_the_main_options"
            "[recipes/accelerate_configs/multinode_grpo.py]",
        ),
        "`multinode_grpo.py --help` exits 1 asking for VLLM_SERVER_URLS instead of printing its options",
    ),  # fmt: skip
    Mutation(
        "readme_snippet_needs_a_gpu",
        "README.md",
        'args=GRPOConfig(output_dir="out", max_steps=100, bf16=False),',
        'args=GRPOConfig(output_dir="out", max_steps=100),',
        ("tests/test_doc_blocks.py::test_doc_block_runs[README.md#use-it-in-your-own-script]",),
        "README's own-script block with TRL's default bf16, which a CPU-only machine refuses",
    ),
    Mutation(
        "errors_doc_names_another_exception",
        "docs/errors.md",
        "| `max_staleness_negative` | `max_staleness=-1` | `ValueError` |",
        "| `max_staleness_negative` | `max_staleness=-1` | `TypeError` |",
        bad_input("max_staleness_negative"),
        "docs/errors.md names an exception the case does not raise",
    ),
    # --------------------------------------------------------------------------------------- tools, environments
    Mutation(
        "tool_tokens_in_the_statistics",
        "trl_async/trainers/engine.py",
        'return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]',
        "return mask",
        (f"{AGENTIC_TEST}::test_mu_staleness_and_offpolicy_figures_stay_exact_with_tool_tokens_masked",),
        "tool tokens (μ = 0.0, TRL's placeholder) enter the correction against μ and the offpolicy/* figures",
    ),
    Mutation(
        "tool_mask_not_handed_to_trl",
        "trl_async/trainers/engine.py",
        "            tool_mask=payload.tool_mask,\n",
        "            tool_mask=None,\n",
        (f"{AGENTIC_TEST}::test_mu_staleness_and_offpolicy_figures_stay_exact_with_tool_tokens_masked",),
        "TRL's loss, num_items_in_batch and the statistics train on the tool's tokens as if the model sampled them",
    ),
    Mutation(
        "tools_run_in_the_trainer",
        "trl_async/trainers/engine.py",
        "trainer_generates_while_starting=args.trainer_generates_while_starting and not uses_agentic_rollouts(self),",
        "trainer_generates_while_starting=args.trainer_generates_while_starting,",
        (f"{AGENTIC_TEST}::test_tools_run_in_the_generation_process_and_the_trainer_trains_on_their_batches",),
        "the trainer makes the first batches itself, running the tools in its own process (where a hung call would "
        "outlive train())",
    ),
    Mutation(
        "tool_timeout_not_enforced",
        "trl_async/rollout/tool_calls.py",
        "        if not self.enforced:\n            yield\n",
        "        if True:\n            yield\n",
        (
            f"{AGENTIC_TEST}::test_a_hanging_tool_ends_the_run_naming_it_and_leaves_nothing_behind",
            f"{AGENTIC_TEST}::test_watchdog_reports_a_late_call_by_name_and_beats_while_calls_run",
        ),
        "a tool that hangs holds the run (the heartbeat, if anything, ends it, naming no tool)",
        timeout=300,
    ),
    Mutation(
        "tool_metrics_gathered_only_when_a_batch_called_a_tool",
        "trl_async/trainers/agentic.py",
        "    if not trainer.tools:\n        return\n",
        "    if not trainer.tools or not payload.tool_call_count:\n        return\n",
        (f"{AGENTIC_TEST}::test_tool_metrics_are_logged_for_every_batch_as_trl_logs_them_even_without_a_call",),
        "a collective joined only by ranks whose batch made a tool call; TRL logs the frequencies for every batch",
    ),
    Mutation(
        "tool_metrics_gather_skipped_on_a_rank_without_calls",
        "trl_async/trainers/agentic.py",
        "    if not trainer.tools:\n        return\n",
        "    if not trainer.tools or not payload.tool_call_count:\n        return\n",
        (f"{AGENTIC_TEST}::test_two_ranks_one_calling_tools_and_one_never_stay_in_step",),
        "with two ranks, the one whose batch made no tool call skips the gather the other joins",
        timeout=600,
    ),
    Mutation(
        "first_round_tool_calls_one_after_another",
        "trl_async/rollout/tool_calls.py",
        "        if self.threads <= 1 or len(calls) < 2:\n",
        "        if True:\n",
        (f"{AGENTIC_TEST}::test_first_round_calls_run_concurrently_each_rollouts_in_order_with_their_own_errors",),
        "tool_call_threads is ignored: the generation process waits for each tool call in turn",
    ),
    Mutation(
        "environments_reset_by_the_trainer_too",
        "trl_async/trainers/engine.py",
        "environments = contextlib.nullcontext() if batch is None else environments_left_to_the_rollouts(self)",
        "environments = contextlib.nullcontext()",
        (f"{AGENTIC_TEST}::test_environment_factory_without_a_dataset_runs_in_the_generation_process",),
        "TRL's scoring of a rollout batch draws and resets the trainer's own environment instances for its rows",
    ),
    Mutation(
        "seeds_interval_uses_the_normal_quantile",
        "benchmarks/render_results.py",
        "    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96\n",
        "    t = 1.96\n",
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "the seeds study's 95% interval over a few seeds uses the normal's 1.96 instead of Student's t: too narrow",
    ),
    Mutation(
        "results_legend_always_defines_earlier",
        "benchmarks/run_all.py",
        '    explained = "".join(f"; {text}" for mark, text in legend.items() if mark in marks)\n',
        '    explained = "".join(f"; {text}" for mark, text in legend.items())\n',
        ("tests/test_run_all.py::test_the_table_legend_explains_only_the_marks_its_rows_use",),
        "README's legend defines _earlier_ (and every other mark) whatever its rows are marked",
    ),
    Mutation(
        "generate_replaced_on_the_instance_is_ignored",
        "trl_async/trainers/engine.py",
        "            check_generate_not_replaced(self.model, self._unwrap(self.model))\n",
        "",
        (
            "tests/test_bad_inputs.py::test_bad_input_is_a_clear_error_and_leaves_nothing_behind[generate_replaced_on_the_instance]",
        ),
        "a generate patched on the trainer's model instance is silently ignored by the generation process",
    ),
    Mutation(
        "fsdp2_generate_registration_refused_as_a_patch",
        "trl_async/config/refusals.py",
        '        return getattr(wrapped, "__func__", None) is not getattr(type(model), "generate", None)\n',
        "        return True\n",
        ("tests/test_sharded.py::test_fsdp2_full_fine_tune_with_checkpoint_wrappers",),
        "FSDP2's registration of generate (transformers' Trainer makes it) is refused as a user's patch",
    ),
    Mutation(
        "core_bound_ignores_the_cores",
        "benchmarks/render_results.py",
        "    return reference, cores, one_thread_s, sync_s / (one_thread_s / cores)\n",
        "    return reference, cores, one_thread_s, sync_s / one_thread_s\n",
        (
            "tests/test_run_all.py::test_the_main_job_states_what_the_cores_allow_from_a_one_thread_run_of_the_same_machine",
        ),
        "the bound of what the cores allow divides by the one-thread time, not by that time over the cores",
    ),
    Mutation(
        "core_bound_from_another_machine",
        "benchmarks/render_results.py",
        '    if here.get("cpu") != there.get("cpu") or here.get("cores") != cores or there.get("cores") != cores:\n',
        "    if False:\n",
        (
            "tests/test_run_all.py::test_the_main_job_states_what_the_cores_allow_from_a_one_thread_run_of_the_same_machine",
        ),
        "the bound of what the cores allow is drawn from a one-thread run of another kind of machine",
    ),
    Mutation(
        "rollout_func_extra_fields_dropped",
        "trl_async/rollout/agentic.py",
        "                if isinstance(values, list) and i < len(values):\n                    row[key] = values[i]",
        "                if False:\n                    row[key] = values[i]",
        (f"{AGENTIC_TEST}::test_rollout_func_runs_in_the_generation_process_and_its_extra_fields_reach_the_rewards",),
        "a rollout_func's per-row fields never reach the reward functions",
    ),
    Mutation(
        "environment_reset_error_unnamed",
        "trl_async/rollout/agentic.py",
        '            with named_errors(f"Raised by {what}',
        '            with named_errors(f"Raised by the environment',
        bad_input("environment_reset_raises"),
        "an environment whose reset raises ends the run without naming which environment",
    ),
    # ------------------------------------------------------------------ several batches per decode (issue 39)
    Mutation(
        "block_reserved_as_soon_as_part_of_it_is_admissible",
        "trl_async/rollout/queue.py",
        "                    if count == max_items or (count and (awaited or self._past_the_end(first + count))):",
        "                    if count:",
        (f"{MULTI_BATCH_TEST}::test_a_block_is_reserved_whole_when_every_batch_of_it_is_admissible",),
        "the generator decodes whatever part of a block is admissible, so blocks shrink to one batch when it runs ahead",
    ),
    Mutation(
        "block_gated_by_its_first_batch",
        "trl_async/rollout/queue.py",
        "            min_version = needed if min_version is None else max(min_version, needed)",
        "            min_version = needed if min_version is None else min_version",
        (f"{MULTI_BATCH_TEST}::test_a_block_is_reserved_whole_when_every_batch_of_it_is_admissible",),
        "a block's weights are gated for its first batch only: its last batches may be older than the bound",
    ),
    Mutation(
        "derived_bound_ignores_the_block",
        "trl_async/config/grpo.py",
        "        args.max_staleness = pipelined_max_staleness(items, *_schedule(args))",
        "        args.max_staleness = pipelined_max_staleness(1, *_schedule(args))",
        (
            f"{MULTI_BATCH_TEST}::test_the_bound_and_the_batches_per_decode_a_config_gets",
            "tests/test_engine.py::test_no_row_older_than_max_staleness_reaches_a_loss[blocks_of_2]",
        ),
        "the derived bound is the one-batch bound, so the blocks the rows ask for never fit in it",
    ),
    Mutation(
        "default_decodes_two_batches",
        "trl_async/config/grpo.py",
        "DEFAULT_ITEMS_PER_DECODE = 1",
        "DEFAULT_ITEMS_PER_DECODE = 2",
        (f"{MULTI_BATCH_TEST}::test_the_bound_and_the_batches_per_decode_a_config_gets",),
        "the default decodes two generation batches per call, at a bound that cost the main job accuracy",
    ),
    Mutation(
        "agentic_runs_decode_blocks",
        "trl_async/config/grpo.py",
        "    if not args.async_generation or args.fixed_staleness is not None or agentic or not rows:",
        "    if not args.async_generation or args.fixed_staleness is not None or not rows:",
        (f"{MULTI_BATCH_TEST}::test_an_agentic_run_decodes_one_batch_at_a_time",),
        "an agentic run asks TRL's one-batch multi-turn loop for a block",
    ),
    Mutation(
        "every_batch_of_a_decode_seeded_alike",
        "trl_async/rollout/backends/hf.py",
        "                generator.manual_seed(int(seed))",
        "                generator.manual_seed(0)",
        (
            f"{MULTI_BATCH_TEST}::test_each_batch_draws_from_its_own_generator",
            f"{MULTI_BATCH_TEST}::test_a_batch_decoded_beside_another_samples_what_it_samples_alone",
        ),
        "the batches of one decode draw from generators seeded alike: their seeds no longer decide their samples",
    ),
    Mutation(
        "sampler_draws_from_the_uniform_not_the_scores",
        "trl_async/rollout/backends/hf.py",
        "        probs = torch.softmax(scores.float(), dim=-1)",
        "        probs = torch.isfinite(scores).float()",
        (f"{MULTI_BATCH_TEST}::test_the_seeded_sampler_draws_from_the_scores_distribution",),
        "the sampler draws uniformly among the allowed tokens instead of from their probabilities",
    ),
    Mutation(
        "split_keeps_the_decode_width",
        "trl_async/rollout/backends/base.py",
        "                        f.name: None if (value := getattr(self, f.name)) is None else value[rows, :width]",
        "                        f.name: None if (value := getattr(self, f.name)) is None else value[rows]",
        (f"{MULTI_BATCH_TEST}::test_split_cuts_each_batch_to_its_own_longest_completion",),
        "a batch decoded beside a longer one keeps the other's padding columns",
    ),
    Mutation(
        "frozen_base_copied_into_the_generator",
        "trl_async/rollout/backends/hf.py",
        "            if source.device == device and source.dtype == parameter.dtype:\n                data = source\n",
        "            if source.device == device and source.dtype == parameter.dtype:\n                data = source.clone()\n",
        (f"{MULTI_BATCH_TEST}::{FAST_START_TEST}",),
        "the generation process copies the frozen base instead of using the shared memory (a second 2 GB at 0.5B)",
    ),
    Mutation(
        "output_embedding_left_untied",
        "trl_async/rollout/backends/hf.py",
        "    if output is None or embedding is None or output.weight is embedding.weight:\n        return",
        "    if True:\n        return",
        (f"{MULTI_BATCH_TEST}::{FAST_START_TEST}",),
        "a model built on meta keeps lm_head untied from the published input embedding",
    ),
    Mutation(
        "compile_fallback_retries_the_broken_compiler",
        "trl_async/rollout/backends/hf.py",
        "            self.generation_config = generation_config_for_rollouts(self.context.generation_config)\n",
        "",
        (f"{MULTI_BATCH_TEST}::test_a_failed_compilation_falls_back_to_eager_decoding_and_is_counted",),
        "after a failed compilation the decode is retried with the same compile settings, and the batch fails",
    ),
    Mutation(
        "every_error_taken_for_a_compile_failure",
        "trl_async/rollout/backends/hf.py",
        "            if not _is_compile_failure(error):\n                raise",
        "            if False:\n                raise",
        (f"{MULTI_BATCH_TEST}::test_a_model_error_under_cuda_graphs_is_not_taken_for_a_compile_failure",),
        "a model or data error under CUDA graphs is swallowed as a compile failure and retried eagerly",
    ),
    Mutation(
        "rows_per_decode_logs_the_batch_rows",
        "trl_async/rollout/pipeline.py",
        '        window["decode_rows_sum"] += batch.payload.decode_rows or rows',
        '        window["decode_rows_sum"] += rows',
        ("tests/test_engine.py::test_no_row_older_than_max_staleness_reaches_a_loss[blocks_of_2]",),
        "async/rows_per_decode logs the rows of each batch, not of the decode that sampled it",
    ),
    Mutation(
        "queue_opened_a_batch_late_between_batches",
        "trl_async/rollout/pipeline.py",
        "        start = self._next_index + (1 if self._making_batch else 0)",
        "        start = self._next_index + 1",
        (f"tests/test_engine.py::{TAKE_OVER_TEST}",),
        "a generation process ready while the trainer trains starts one batch late: a stream batch is never trained on",
    ),
    Mutation(
        "queue_opened_only_when_the_trainer_asks",
        "trl_async/rollout/pipeline.py",
        "        if generates_while_starting:\n            self._opener = threading.Thread(",
        "        if False:\n            self._opener = threading.Thread(",
        (f"tests/test_engine.py::{TAKE_OVER_TEST}",),
        "a ready generation process waits for the trainer's next batch request (half a minute at 0.5B on a CPU)",
    ),
    Mutation(
        "batches_reserved_past_the_end_of_the_run",
        "trl_async/rollout/queue.py",
        "        return c.last_index >= 0 and index > c.last_index + c.evicted_items",
        "        return False",
        (
            f"{MULTI_BATCH_TEST}::test_nothing_is_reserved_beyond_the_end_of_the_run_but_what_the_consumer_waits_for",
            "tests/test_engine.py::test_no_row_older_than_max_staleness_reaches_a_loss[blocks_of_2]",
        ),
        "the generation process decodes batches no step will train on, competing with the trainer's last steps",
    ),
    Mutation(
        "fixed_staleness_waits_for_loads_past_the_end",
        "trl_async/rollout/queue.py",
        "        if loaded >= 0 and (self.min_generation_version(loaded) >= version or self._past_the_end(loaded)):",
        "        if loaded >= 0 and self.min_generation_version(loaded) >= version:",
        ("tests/test_fixed_staleness.py",),
        "with fixed staleness the trainer's last publishes wait for loads the generation process never makes (a hang)",
        timeout=120,  # the file passes in ~27 s on the real code
    ),
    Mutation(
        "cuda_graphs_on_a_cpu_accepted",
        "trl_async/config/refusals.py",
        '    if args.async_generation and setting == "on" and torch.device(generation_device).type != "cuda":',
        "    if False:",
        bad_input("cuda_graphs_on_a_cpu"),
        "generation_cuda_graphs='on' on a CPU is accepted and silently decodes without CUDA graphs",
    ),
    Mutation(
        "rows_per_decode_below_a_batch_accepted",
        "trl_async/config/grpo.py",
        "        not isinstance(rows_cap, int) or rows is None or rows_cap >= rows,",
        "        True,",
        bad_input("rows_per_decode_below_a_batch"),
        "a cap below one generation batch is accepted (and silently decodes the whole batch anyway)",
    ),
    Mutation(
        "continuous_batching_ignored",
        "trl_async/config/grpo.py",
        '        not (args.async_generation and getattr(args, "use_transformers_continuous_batching", False)),',
        "        True,",
        bad_input("continuous_batching_async"),
        "TRL's use_transformers_continuous_batching is silently ignored by the generation process",
    ),
]


# ------------------------------------------------------------------------------------------- gpu_check (issues 39/40)
GPU_CHECK_TEST = "tests/test_gpu_check.py"
GPU_CHECK_MUTATIONS = [
    Mutation(
        "sharded_control_is_the_tagged_version",
        "tests/scripts/sharded_ranks.py",
        "            candidates = control_candidates(version, self.whole_weights)\n",
        "            candidates = [(version, 0.0)]\n",
        ("tests/test_sharded.py::test_fsdp2_full_fine_tune_with_checkpoint_wrappers",),
        "the FSDP2 check's control compares μ with the tagged version's own weights: a control that cannot fail",
    ),
    Mutation(
        "sharded_control_first_other_version",
        "tests/support/weights.py",
        "        if best is None or gap > best[1]:\n",
        "        if best is None:\n",
        ("tests/test_sharded.py::test_the_control_compares_with_weights_other_than_the_tagged_ones",),
        "the control takes the first other version, which on one GPU rank held the same weights as the tagged one",
    ),
    Mutation(
        "sharded_control_by_weights_only",
        "tests/support/weights.py",
        "    for version in (others[0], others[-1]):\n",
        "    for version in ():\n",
        ("tests/test_sharded.py::test_the_control_compares_with_weights_other_than_the_tagged_ones",),
        "the control is the version farthest in weights only, which may leave a batch's log-probs where they were "
        "(a 100-step ZeRO-3 run: 2e-4 under weights 0.07 away)",
    ),
    Mutation(
        "steady_clock_from_the_first_step",
        "benchmarks/gpu_check.py",
        "        start = (max(made) if made else 0) + 1\n",
        "        start = 1\n",
        (
            f"{GPU_CHECK_TEST}::test_the_async_clock_starts_after_the_last_step_trained_on_a_batch_the_trainer_made_itself",
        ),
        "an async run's steady-state clock starts with its first step, on batches the trainer made itself",
    ),
    Mutation(
        "steady_clock_after_the_first_generator_step_only",
        "benchmarks/gpu_check.py",
        "        start = (max(made) if made else 0) + 1\n",
        "        start = (min(made) if made else 0) + 1\n",
        (
            f"{GPU_CHECK_TEST}::test_the_async_clock_starts_after_the_last_step_trained_on_a_batch_the_trainer_made_itself",
        ),
        "the clock starts after the first trainer-made step, though the trainer made another batch later",
    ),
    Mutation(
        "steady_clock_before_the_first_batch_queued",
        "benchmarks/gpu_check.py",
        "            while start <= n and step_ends[start - 1] < first_batch_queued:\n",
        "            while False:\n",
        (f"{GPU_CHECK_TEST}::test_the_async_clock_never_starts_before_the_generator_queued_its_first_batch",),
        "the steady-state clock may start before the generation process queued its first batch",
    ),
    Mutation(
        "sync_clock_off_the_generation_cycle",
        "benchmarks/gpu_check.py",
        "        start = max(1, math.ceil(warmup_steps / cycle) * cycle)\n",
        "        start = max(1, warmup_steps)\n",
        (f"{GPU_CHECK_TEST}::test_a_synchronous_clock_starts_after_its_warm_up_on_whole_generation_cycles",),
        "TRL's clock with steps_per_generation > 1 starts mid-cycle, counting a generate call it did not time",
    ),
    Mutation(
        "sm_utilisation_of_the_whole_check",
        "benchmarks/gpu_check.py",
        "if g == gpu and sm is not None and start - 1 <= t <= end + 1]",
        "if g == gpu and sm is not None]",
        (f"{GPU_CHECK_TEST}::test_sm_utilisation_is_the_median_of_the_dmon_samples_inside_the_window",),
        "a run's SM utilisation is the median over the whole dmon record, not over its own window",
    ),
    Mutation(
        "a_crashing_dtype_stops_the_comparison",
        "benchmarks/gpu_check.py",
        '            results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}\n',
        "            raise\n",
        (f"{GPU_CHECK_TEST}::test_a_dtype_that_crashes_is_recorded_and_the_others_are_still_compared",),
        "the CPU-vs-CUDA comparison dies on the first dtype that crashes (float64 did), comparing nothing",
    ),
    Mutation(
        "rows_per_decode_sweep_without_the_field",
        "benchmarks/gpu_check.py",
        "        if has_rows_per_decode:\n",
        "        if True:\n",
        (
            f"{GPU_CHECK_TEST}::test_the_throughput_plan_sweeps_rows_per_decode_beside_trl_with_matched_steps_per_generation",
        ),
        "the sweep is planned on a checkout whose AsyncGRPOConfig has no max_rows_per_decode (each run would crash)",
    ),
    Mutation(
        "trl_steps_per_generation_not_set",
        "benchmarks/gpu_check.py",
        '    return GRPOConfig(**common, **({} if steps is None else {"steps_per_generation": steps}))\n',
        "    return GRPOConfig(**common)\n",
        (f"{GPU_CHECK_TEST}::test_each_run_trains_with_the_arguments_its_name_says",),
        "TRL's matched runs train at TRL's defaults: one generate call of 32 rows a step whatever their name says",
    ),
    Mutation(
        "run_past_the_time_left",
        "benchmarks/gpu_check.py",
        "    if estimate > left:\n",
        "    if False:\n",
        (f"{GPU_CHECK_TEST}::test_a_run_that_does_not_fit_the_time_left_is_skipped_and_one_that_fits_gets_a_cap",),
        "a run that does not fit the section's time left starts anyway, to be killed by the section's limit",
    ),
    Mutation(
        "gpu_pair_with_a_run_short_of_steady_state",
        "benchmarks/render_results.py",
        'if all(r.get("steady_state") and r.get("rows_per_s_steady") for r in (ra, rb)):',
        'if all(r.get("rows_per_s_steady") for r in (ra, rb)):',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "RESULTS.md pairs a GPU run that never reached its steady state (stopped at its cap) with TRL",
    ),
    Mutation(
        "gpu_rows_per_decode_paired_with_trl_defaults",
        "benchmarks/render_results.py",
        '            "trl/defaults" if k == 1 else f"trl/steps_per_generation={k}"',
        '            "trl/defaults"',
        ("tests/test_run_all.py::test_render_only_renders_every_section_from_the_per_run_records",),
        "a rows-per-decode run is compared with TRL's defaults where the table says 'same steps_per_generation'",
    ),
]
MUTATIONS += GPU_CHECK_MUTATIONS


def copy_repository(destination: str) -> None:
    ignore = shutil.ignore_patterns(".git", "venv*", ".venv", "outputs", "__pycache__", ".pytest_cache", "*.egg-info",
                                    ".hypothesis", "results")  # fmt: skip
    shutil.copytree(ROOT, destination, ignore=ignore, dirs_exist_ok=True)


def check_text(mutation: Mutation, root: str) -> str:
    """The mutated file's text; exits when the text to replace does not occur exactly once."""
    with open(os.path.join(root, mutation.path)) as f:
        text = f.read()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name}: the text to replace occurs {count} times in {mutation.path}")
    return text


def apply(mutation: Mutation, root: str) -> None:
    path = os.path.join(root, mutation.path)
    text = check_text(mutation, root).replace(mutation.old, mutation.new)
    if path.endswith(".py"):
        compile(text, path, "exec")  # a mutant must be valid Python: a syntax error would 'kill' it trivially
    with open(path, "w") as f:
        f.write(text)


# What every guard run imports and no mutation touches (the third-party libraries, not `trl_async`, `tests`,
# `benchmarks` or `recipes`): imported once in a fork server, whose children then start each mutant's pytest with them
# loaded. A fresh interpreter per mutant spent seconds on these imports alone (about half of a median mutant's time).
GUARD_PRELOAD = ("torch", "transformers", "datasets", "accelerate", "peft", "trl", "pytest", "hypothesis")
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow")


def _guards_in_child(root: str, guards: tuple[str, ...], log_path: str) -> None:
    """A fork-server child: runs pytest on the guards against the mutant in `root`, output to `log_path`, and exits
    with pytest's status. Its own session, so that a timeout kills what its tests started too."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    leaked = [name for name in ("trl_async", "tests", "benchmarks", "recipes") if name in sys.modules]
    if leaked:  # the mutant's code must be imported from its copy, never inherited from the server
        print(f"the fork server already imported {leaked}: the guards would not test the mutant", flush=True)
        os._exit(4)
    os.chdir(root)
    os.environ.update(PYTHONPATH=root, OMP_NUM_THREADS="1")  # the processes the tests start import the mutant too
    sys.path.insert(0, root)
    import pytest

    code = pytest.main([*PYTEST_ARGS, *guards])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def run_guards(mutation: Mutation, root: str, timeout: float, ctx) -> tuple[bool, str]:
    log_path = os.path.join(root, ".mutation-guards.log")
    process = ctx.Process(target=_guards_in_child, args=(root, mutation.guards, log_path))
    process.start()
    process.join(timeout)
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.join()
        return True, "timed out (counted as killed: the mutant hangs)"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # anything its tests left running
    with open(log_path, errors="replace") as f:
        tail = f.read().strip().splitlines()[-1:] or [""]
    if process.exitcode in (2, 3, 4, 5):  # interrupted, internal error, usage error, no tests collected
        raise SystemExit(f"mutation {mutation.name}: pytest could not run its guards ({tail[0]})")
    return process.exitcode == 1, tail[0]


# Guards run on the unmutated copy first, through the same fork server: they must pass there, or a failure under a
# mutant could come from how the guards are started rather than from the mutation (a pure-tensor test and one that
# trains with a real generation process).
BASELINE_GUARDS = (
    "tests/test_losses.py::test_paper_rule_example_by_hand",
    "tests/test_engine.py::test_no_row_older_than_max_staleness_reaches_a_loss",
)


def guard_server():
    """The fork server the guards start from, with `GUARD_PRELOAD` imported (one thread per process, as CI runs)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(GUARD_PRELOAD))
    return ctx


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--only", help="comma-separated mutation names")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutation")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once (default: 1)")
    args = parser.parse_args(argv)
    mutations = MUTATIONS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m.name for m in MUTATIONS}
        if unknown:
            raise SystemExit(f"unknown mutations: {sorted(unknown)}")
        mutations = [m for m in MUTATIONS if m.name in wanted]
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.why}\n    {m.path}; guarded by {', '.join(m.guards)}")
        return 0
    survivors = []
    ctx = guard_server()
    with tempfile.TemporaryDirectory(prefix="trl_async-mutants-") as pristine:
        copy_repository(pristine)
        for m in mutations:  # every text checked before the first mutant runs
            check_text(m, pristine)
        baseline = Mutation("baseline", "", "", "", BASELINE_GUARDS, "")
        failed, tail = run_guards(baseline, pristine, args.timeout, ctx)
        if failed:
            raise SystemExit(f"the guards fail on the unmutated code when started from the fork server: {tail}")

        def test_mutant(m: Mutation) -> tuple[bool, str, float]:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as root:
                shutil.copytree(pristine, root, dirs_exist_ok=True)
                apply(m, root)
                killed, tail = run_guards(m, root, m.timeout or args.timeout, ctx)
            return killed, tail, time.perf_counter() - start

        # Each mutant runs in its own copy, its guards in their own processes (spools, ports and checks of leftovers
        # are per process), so several can run at once.
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            # The mutants with a declared timeout (the guards that run for minutes, or hang) first, so that none of
            # them starts last and leaves one job running alone at the end.
            order = sorted(mutations, key=lambda m: -(m.timeout or 0))
            futures = {pool.submit(test_mutant, m): m for m in order}
            for future in concurrent.futures.as_completed(futures):
                m = futures[future]
                killed, tail, seconds = future.result()
                verdict = "killed" if killed else "SURVIVED"
                print(f"{verdict:8s} {m.name:34s} {seconds:6.0f}s  {tail}", flush=True)
                if not killed:
                    survivors.append(m.name)
    print(f"\n{len(mutations) - len(survivors)}/{len(mutations)} mutations killed")
    if survivors:
        print("surviving (missing tests): " + ", ".join(survivors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
