"""What several tests share, imported as `tests.support.<module>` (the repository root is on the path: pytest puts it
there for the `tests` package, and `tests/conftest.py` hands it to subprocesses through PYTHONPATH).

* `trainer_utils`: the bundled tiny model, small configs, rewards, process checks, `WeightTracingTrainer` (staleness
  measured from the weights that really generated each batch);
* `references`, `authors_m2po`: independent re-derivations the library is compared with;
* `math_completions`: labelled completions for the math-answer reward (written by hand per category);
* `faults`: the records of `tests/scripts/faulty_run.py` and the check that nothing is left behind;
* `hub`: the Hugging Face Hub stand-in, over HTTP (`hub.server`, pushes and loads) and as a pre-filled offline cache
  (`hub.cache`, for TRL's own test suite in `benchmarks/trl_compat`);
* `vllm`: helpers of the vLLM tests (`tests/vllm_backend`, run in the vLLM environment);
* `weights`: reading a weight store's consistent snapshot;
* `doc_blocks`, `doc_stand_ins`: the code blocks of README and docs/ and what `tests/test_doc_blocks.py` runs for
  each (the stand-ins live in the child process that runs a Python block).
"""
