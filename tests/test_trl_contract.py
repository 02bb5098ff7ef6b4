"""What the trainers assume of TRL's private `GRPOTrainer` API (`trl_async.trl_contract`), checked against the
installed TRL by running TRL's own methods: an upgrade that changes a hook's signature, the `_generate` tuple or the
call order the hook slot relies on fails here, naming it."""

from __future__ import annotations

import dataclasses

import pytest
from trl import GRPOConfig, GRPOTrainer

from tests.support.trainer_utils import length_reward, load_model, load_tokenizer, make_args
from trl_async import AsyncGRPOTrainer, AsyncPPOConfig, AsyncPPOTrainer, trl_contract
from trl_async.toy import make_arithmetic_dataset
from trl_async.trainers.engine import AsyncRolloutMixin


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=32, num_test=8, seed=3)["train"]


# ----------------------------------------------------------------------------------------------- signatures
def test_trl_hooks_have_the_signatures_the_trainers_override():
    assert trl_contract.hook_mismatches(GRPOTrainer) == []


def test_a_changed_hook_signature_is_reported_by_name():
    class RenamedArgument(GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids):  # TRL renamed one
            return None

        def _compute_loss(self, model, batch):
            return None

    mismatches = trl_contract.hook_mismatches(RenamedArgument)
    assert [m.split("(")[0] for m in mismatches] == ["_calculate_rewards", "_compute_loss"], mismatches
    with pytest.warns(RuntimeWarning, match="_calculate_rewards"):
        trl_contract.check_hooks(RenamedArgument)


def test_the_trainers_override_only_hooks_named_in_the_contract():
    """Every TRL method the trainers replace is one the contract names (so a TRL change to it is caught above)."""
    trl_methods = {name for name in dir(GRPOTrainer) if callable(getattr(GRPOTrainer, name, None))}
    for trainer_class in (AsyncGRPOTrainer, AsyncPPOTrainer):
        ours = {
            name
            for klass in trainer_class.__mro__[: trainer_class.__mro__.index(GRPOTrainer)]
            for name in vars(klass)
            if callable(vars(klass)[name])
        }
        replaced = (ours & trl_methods) - {"__init__", "create_model_card", "train", "save_model", "create_optimizer"}
        replaced -= {"_load_from_checkpoint"}  # Trainer's, not GRPOTrainer's private API
        assert replaced <= set(trl_contract.HOOKS), sorted(replaced - set(trl_contract.HOOKS))


# ----------------------------------------------------------------------------------------------- _generate's tuple
class _RecordingTRL(GRPOTrainer):
    """TRL's own trainer, recording the order of the hooks it calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.generated = None

    def _generate(self, prompts):
        self.calls.append("_generate")
        self.generated = super()._generate(prompts)
        return self.generated

    def _calculate_rewards(self, *args, **kwargs):
        self.calls.append("_calculate_rewards")
        return super()._calculate_rewards(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        self.calls.append("forward")
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)


class _ReadRecordingDict(dict):
    def __init__(self, *args, reads: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = reads

    def __getitem__(self, key):
        self.reads.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.reads.append(key)
        return super().get(key, default)


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory, tokenizer, dataset):
    args = make_args(tmp_path_factory.mktemp("contract"), config_cls=GRPOConfig, max_completion_length=8)
    trainer = _RecordingTRL(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.model.train()
    return trainer


def test_generate_returns_the_fields_in_the_contracts_order(trl_trainer, tokenizer):
    prompts = [row["prompt"] for row in trl_trainer.train_dataset.select(range(2))]
    fields = trl_contract.generate_fields(trl_trainer._generate(prompts))
    # Identified by content, not position: the prompts' token ids, the completions' ids and their decoding.
    expected_prompts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]  # fmt: skip
    assert [list(p) for p in fields["prompt_ids"]] == [list(p) for p in expected_prompts]
    assert len(fields["completion_ids"]) == 2  # one completion per prompt row (TRL's sampler repeats the rows)
    decoded = tokenizer.batch_decode(fields["completion_ids"], skip_special_tokens=True)
    assert [c[0]["content"] for c in fields["completions"]] == decoded
    assert fields["tool_mask"] is None and fields["logprobs"] is None and fields["images"] is None
    assert fields["extra_fields"] == {} and fields["tool_images"] == []


def test_generate_result_builds_trls_tuple_by_name():
    values = {name: object() for name in trl_contract.GENERATE_FIELDS}
    assert trl_contract.generate_fields(trl_contract.generate_result(**values)) == values
    with pytest.raises(TypeError, match="tool_mask"):
        trl_contract.generate_result(**{k: v for k, v in values.items() if k != "tool_mask"})


# ----------------------------------------------------------------------------------------------- call order
def test_scoring_calls_generate_then_rewards_once_each(trl_trainer, dataset):
    rows = [dataset[i] for i in range(trl_trainer.args.generation_batch_size // trl_trainer.num_generations)]
    rows = [row for row in rows for _ in range(trl_trainer.num_generations)]
    trl_trainer.calls.clear()
    trl_trainer._generate_and_score_completions(rows)
    hooks = [c for c in trl_trainer.calls if c != "forward"]
    assert hooks == ["_generate", "_calculate_rewards"], trl_trainer.calls


def test_compute_loss_runs_the_policy_forward_before_reading_the_advantages(trl_trainer, dataset):
    rows = [dataset[i] for i in range(trl_trainer.args.generation_batch_size // trl_trainer.num_generations)]
    rows = [row for row in rows for _ in range(trl_trainer.num_generations)]
    batch = trl_trainer._generate_and_score_completions(rows)
    order: list = []
    recorded = _ReadRecordingDict(batch, reads=order)
    trl_trainer.calls = order  # the forward's calls go into the same list as the dict's reads
    trl_trainer.current_gradient_accumulation_steps = 1
    trl_trainer._compute_loss(trl_trainer.model, recorded)
    assert "forward" in order and "advantages" in order, order
    assert order.index("forward") < order.index("advantages"), order


@pytest.mark.parametrize(
    "schedule",
    [
        {},  # one micro-batch per generation batch, one per optimizer step: used within one step
        {"steps_per_generation": 2},  # a generation batch over two optimizer steps
        {"gradient_accumulation_steps": 2, "steps_per_generation": 2},  # two micro-steps, one optimizer step
        {"num_iterations": 2},  # reused: two optimizer steps
    ],
    ids=["within_one_step", "over_two_steps", "accumulated", "two_iterations"],
)
def test_trl_computes_old_logps_exactly_when_the_contract_says(tmp_path, tokenizer, dataset, schedule):
    """`computes_old_logps(args)` decides, from the config alone, whether a batch carries TRL's π_old; TRL's own
    scoring must agree (the trainers never look for the key)."""
    args = make_args(tmp_path, config_cls=GRPOConfig, max_completion_length=4, **schedule)
    trainer = GRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.model.train()
    rows = [dataset[i] for i in range(args.generation_batch_size // args.num_generations)]
    batch = trainer._generate_and_score_completions([row for row in rows for _ in range(args.num_generations)])
    assert (batch.get("old_per_token_logps") is not None) == trl_contract.computes_old_logps(args)
    assert trl_contract.computes_old_logps(args) == (schedule not in ({}, {"gradient_accumulation_steps": 2,
                                                                          "steps_per_generation": 2}))  # fmt: skip


# ----------------------------------------------------------------------------------------------- the hook slot
def test_the_hook_slot_lives_for_one_trl_call_only(tmp_path, tokenizer, dataset):
    seen = {}

    class Probe(AsyncGRPOTrainer):
        def _calculate_rewards(self, *args, **kwargs):
            seen["slot_in_call"] = self._hook_slot
            return super()._calculate_rewards(*args, **kwargs)

    args = make_args(tmp_path, max_steps=2, max_completion_length=8, trainer_generates_while_starting=False)
    trainer = Probe(model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset,
                    processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert seen["slot_in_call"] is not None and seen["slot_in_call"].batch is not None
    assert seen["slot_in_call"].rewards_per_func is not None  # what the call returned, recorded for PPO
    assert trainer._hook_slot is None
    # No TRL hook was assigned on the instance.
    assert not set(trainer.__dict__) & set(trl_contract.HOOKS)


# ----------------------------------------------------------------------------------------------- the config
def _grpo_post_init_probe(require_groups: bool):
    @dataclasses.dataclass
    class Probe(GRPOConfig):
        def __post_init__(self):
            trl_contract.finish_grpo_config(self, require_groups=require_groups)

    return Probe


CONFIG_GRID = [
    dict(per_device_train_batch_size=8, num_generations=4),
    dict(per_device_train_batch_size=8, num_generations=4, steps_per_generation=3),
    dict(per_device_train_batch_size=8, num_generations=2, generation_batch_size=24),
    dict(per_device_train_batch_size=8, num_generations=2, generation_batch_size=20),  # not a multiple: error
    dict(per_device_train_batch_size=8, num_generations=2, generation_batch_size=16, steps_per_generation=2),
    dict(per_device_train_batch_size=6, num_generations=4),  # 6 % 4: error
    dict(per_device_train_batch_size=8, num_generations=1),  # GRPO's group check
    dict(per_device_train_batch_size=8, num_generations=4, pad_to_multiple_of="64", scale_rewards=True),
    dict(per_device_train_batch_size=8, num_generations=4, pad_to_multiple_of="none", scale_rewards=False),
    dict(
        per_device_train_batch_size=8,
        num_generations=4,
        vllm_importance_sampling_clip_min=2.0,
        vllm_importance_sampling_clip_max=1.0,
    ),  # fmt: skip
    dict(
        per_device_train_batch_size=8,
        num_generations=4,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=None,
    ),  # fmt: skip
    dict(per_device_train_batch_size=8, num_generations=4, vllm_importance_sampling_cap=5.0),
    dict(per_device_train_batch_size=8, num_generations=4, auto_find_batch_size=True),
    dict(per_device_train_batch_size=8, num_generations=4, log_completions_hub_repo="me/x"),
    dict(
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=3,
        do_eval=True,
        eval_strategy="steps",
        per_device_eval_batch_size=6,
    ),  # fmt: skip
]


@pytest.mark.parametrize("settings", CONFIG_GRID, ids=range(len(CONFIG_GRID)))
def test_finish_grpo_config_is_grpo_configs_post_init(tmp_path, settings):
    common = dict(output_dir=str(tmp_path), report_to="none", bf16=False)

    def build(cls):
        try:
            return cls(**common, **settings).to_dict(), None
        except ValueError as error:
            return None, str(error)

    with pytest.warns() if "vllm_importance_sampling_cap" in settings else _no_check():
        theirs = build(GRPOConfig)
    with pytest.warns() if "vllm_importance_sampling_cap" in settings else _no_check():
        ours = build(_grpo_post_init_probe(require_groups=True))
    assert ours == theirs


def test_without_the_group_check_one_completion_per_prompt_is_valid(tmp_path):
    config = _grpo_post_init_probe(require_groups=False)(
        output_dir=str(tmp_path), report_to="none", bf16=False, per_device_train_batch_size=7, num_generations=1
    )
    assert (config.generation_batch_size, config.steps_per_generation) == (7, 1)
    ppo = AsyncPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, per_device_train_batch_size=7)
    assert ppo.num_generations == 1 and type(ppo.num_generations) is int and ppo.generation_batch_size == 7


class _no_check:  # noqa: N801 (a context manager)
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_ppo_is_not_a_grpo_subclass_both_share_the_mixin():
    assert not issubclass(AsyncPPOTrainer, AsyncGRPOTrainer)
    assert AsyncPPOTrainer.__mro__[1] is AsyncRolloutMixin and AsyncGRPOTrainer.__mro__[1] is AsyncRolloutMixin


# ----------------------------------------------------------------------------------------------- multi-turn code
@pytest.fixture(scope="module")
def tools_tokenizer():
    from transformers import AutoTokenizer

    from trl_async.toy import tiny_tools_model_path

    return AutoTokenizer.from_pretrained(tiny_tools_model_path())


def test_trls_multi_turn_code_reads_what_the_generation_process_host_provides(tools_tokenizer):
    """The generation process runs TRL's `_generate`, `_tokenize_prompts`, `_tool_call_loop` and
    `_get_tool_suffix_ids` on `ToolLoopHost`: they read exactly the attributes the contract lists, and the host has
    every one of them."""
    from trl_async.rollout.agentic import ToolLoopHost

    assert trl_contract.host_attribute_mismatches(GRPOTrainer) == []
    host = ToolLoopHost(tools_tokenizer, lambda prompt_ids: (prompt_ids, None))
    read = {name for names in trl_contract.TOOL_LOOP_HOST_ATTRIBUTES.values() for name in names}
    assert sorted(name for name in read if not hasattr(host, name)) == []


def test_a_new_attribute_read_by_trls_tool_loop_is_reported_by_name():
    class Upgraded(GRPOTrainer):
        def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, fields):
            return self.tool_parser, self._sync_tool_dicts  # a TRL that reads a new attribute

    mismatches = trl_contract.host_attribute_mismatches(Upgraded)
    assert any(m.startswith("_tool_call_loop now reads self.tool_parser") for m in mismatches), mismatches
    assert any(m.startswith("_tool_call_loop no longer reads self.") for m in mismatches), mismatches
    with pytest.raises(AttributeError, match="trainer.tool_parser"):
        from trl_async.rollout.agentic import ToolLoopHost

        ToolLoopHost.__getattr__(object.__new__(ToolLoopHost), "tool_parser")


def test_trls_tool_loop_returns_its_fields_in_the_contracts_order(tools_tokenizer):
    """TRL's `_generate` and `_tool_call_loop` on the host, with a scripted model: a tool call, then an answer. The
    fields read by name (`tool_loop_fields`, `generate_fields`) are the ones TRL computed: one call, no failure, the
    tool's tokens masked 0 with μ 0.0, the model's tokens 1 with their μ."""
    from trl_async.rollout.agentic import ToolLoopHost
    from trl_async.toy.tools import multiply, tool_call_text, tool_suffix_ids

    def ids(text):
        return tools_tokenizer(text, add_special_tokens=False)["input_ids"]

    turns = [ids(tool_call_text("multiply", {"a": 3, "b": 4}) + "<|im_end|>"), ids("#### 12<|im_end|>")]
    calls = iter(turns)

    def generate_turn(prompt_ids):
        completion = next(calls)
        return [completion] * len(prompt_ids), [[-0.5] * len(completion)] * len(prompt_ids)

    from transformers import AutoConfig

    from trl_async.toy import tiny_tools_model_path

    config = AutoConfig.from_pretrained(tiny_tools_model_path())
    host = ToolLoopHost(
        tools_tokenizer, generate_turn, model_config=config, tools=[multiply], max_completion_length=96
    )
    host._sync_tool_dicts, host._async_tool_dicts = [{"multiply": multiply}], [{}]
    fields = trl_contract.generate_fields(host.run([[{"role": "user", "content": "What is 3*4?"}]]))
    assert (host.tool_call_count, host.tool_failure_count) == (1, 0)
    suffix = tool_suffix_ids(tools_tokenizer, [{"role": "tool", "name": "multiply", "content": "12"}])
    assert fields["completion_ids"] == [turns[0] + suffix + turns[1]]
    assert fields["tool_mask"] == [[1] * len(turns[0]) + [0] * len(suffix) + [1] * len(turns[1])]
    assert fields["logprobs"] == [[-0.5] * len(turns[0]) + [0.0] * len(suffix) + [-0.5] * len(turns[1])]
    assert [m["role"] for m in fields["completions"][0]] == ["assistant", "tool", "assistant"]


def test_trl_sets_up_what_agentic_runs_read_of_the_trainer(tmp_path, tools_tokenizer):
    from trl_async.toy import tiny_tools_model_path
    from trl_async.toy.tools import make_multiplication_dataset, multiply

    class Counter:
        def reset(self, **kwargs): ...

        def increment(self, step: int) -> int:
            """
            Add to the counter.

            Args:
                step: How much.
            """
            return step

    trainer = GRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=length_reward,
        args=make_args(tmp_path, config_cls=GRPOConfig, max_completion_length=8),
        train_dataset=make_multiplication_dataset(num_train=16, num_test=0)["train"],
        tools=[multiply],
        environment_factory=Counter,
    )
    missing = [name for name in trl_contract.AGENTIC_TRAINER_ATTRIBUTES if not hasattr(trainer, name)]
    assert missing == []
    assert trainer._standalone_tools == [multiply] and list(trainer.environment_factories) == [None]
    assert [tool.__name__ for tool in trainer.tools] == ["multiply", "increment"]


def test_a_call_trls_tool_loop_makes_out_of_the_first_rounds_order_stops_the_batch(tools_tokenizer):
    """With `tool_call_threads` > 1 the first round's calls are made before TRL's loop, in the order of each rollout's
    first turn, and handed to TRL's loop as it makes them. A TRL that made them in another order would pair results
    with the wrong calls: the check must stop the batch with its message through TRL 1.16's real `_tool_call_loop`,
    which turns every `Exception` of a tool call into an `{'error': ...}` result and goes on."""
    from transformers import AutoConfig

    from trl_async.rollout.agentic import ToolLoopHost
    from trl_async.rollout.tool_calls import FirstRoundCalls, PrefetchedTool, ToolLoopContractError
    from trl_async.toy import tiny_tools_model_path
    from trl_async.toy.tools import multiply, tool_call_text

    class LastToFirstRound(FirstRoundCalls):
        """The first round as it would be if TRL called a rollout's tools last to first, as a TRL could: the calls of
        each first turn made in reverse order. TRL 1.16's loop, run below, makes them first to last."""

        def start(self, completions, sync_dicts):
            reversed_turns = [[{**turn[0], "tool_calls": turn[0].get("tool_calls", [])[::-1]}] for turn in completions]
            super().start(reversed_turns, sync_dicts)

    def ids(text):
        return tools_tokenizer(text, add_special_tokens=False)["input_ids"]

    two_calls = ids(tool_call_text("multiply", {"a": 3, "b": 4}) + "\n" + tool_call_text("multiply", {"a": 5, "b": 6})
                    + "<|im_end|>")  # fmt: skip
    turns = iter([two_calls, ids("#### 12<|im_end|>")])

    def generate_turn(prompt_ids):
        completion = next(turns)
        return [completion] * len(prompt_ids), [[-0.5] * len(completion)] * len(prompt_ids)

    first_round = LastToFirstRound(threads=2)
    host = ToolLoopHost(tools_tokenizer, generate_turn, model_config=AutoConfig.from_pretrained(tiny_tools_model_path()),
                        tools=[multiply], max_completion_length=96, first_round=first_round)  # fmt: skip
    host._sync_tool_dicts = [{"multiply": PrefetchedTool(multiply, row, "multiply", first_round)} for row in range(2)]
    host._async_tool_dicts = [{}, {}]
    prompts = [[{"role": "user", "content": "What is 3*4 and 5*6?"}] for _ in range(2)]
    with pytest.raises(ToolLoopContractError, match=r"TRL changed how it runs the calls.*set tool_call_threads=1"):
        host.run(prompts)
