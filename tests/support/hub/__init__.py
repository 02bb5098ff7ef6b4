"""The Hugging Face Hub stand-in, in its two forms:

* `server.HubStub`: the Hub at its HTTP boundary (`HF_ENDPOINT`), for pushes and loads through the real client;
* `cache.build_hub`: the repositories TRL's own tests load, pre-filled into an offline Hub and datasets cache, for
  running TRL's GRPO test file (`benchmarks/trl_compat`), which also loads datasets.
"""
