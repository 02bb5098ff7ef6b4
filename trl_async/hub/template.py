"""The text of the model card: its Jinja template and the citations it prints.

`card.py` fills the template (`ModelCard.from_template`) with what `CardSummary` holds; the template's variables are
the keyword arguments of `build_model_card`'s `ModelCard.from_template` call.
"""

M2PO_PAPER = {
    "title": "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
    "id": "2510.01161",
    "citation": """@article{zheng2025prosperity,
    title        = {{Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?}},
    author       = {Haizhong Zheng and Jiawei Zhao and Beidi Chen},
    year         = 2025,
    eprint       = {arXiv:2510.01161},
}""",
}
PPO_PAPER = {
    "title": "Proximal Policy Optimization Algorithms",
    "id": "1707.06347",
    "citation": """@article{schulman2017proximal,
    title        = {{Proximal Policy Optimization Algorithms}},
    author       = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
    year         = 2017,
    eprint       = {arXiv:1707.06347},
}""",
}
TRL_CITATION = """@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}"""

CARD_TEMPLATE = """---
{{ card_data }}
---

# Model card for {{ model_name }}

{% if is_adapter %}This is a LoRA adapter{% else %}This model is a fine-tuned version{% endif %} of {% if base_model %}[{{ base_model }}](https://huggingface.co/{{ base_model }}){% else %}a local model (`{{ base_model_path }}`){% endif %}{% if dataset_name %}, trained on [{{ dataset_name }}](https://huggingface.co/datasets/{{ dataset_name }}){% endif %} with reinforcement learning: {{ method }}, using [trl_async](https://github.com/trl-async/trl_async) on top of [TRL](https://github.com/huggingface/trl).

## Quick start

```python
{% if is_adapter %}from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base = AutoModelForCausalLM.from_pretrained("{{ base_model or 'path/to/the/base/model' }}")
model = PeftModel.from_pretrained(base, "{{ load_id }}")
tokenizer = AutoTokenizer.from_pretrained("{{ load_id }}")
{% else %}from transformers import pipeline

generator = pipeline("text-generation", model="{{ load_id }}")
{% endif %}```
{% if eval %}
## Results

Greedy decoding (at most {{ eval.max_new_tokens }} new tokens) on {{ eval.num_samples }} held-out problems of `{{ eval.dataset }}`{% if eval.split %} (split `{{ eval.split }}`){% endif %}, scored by exact match of the final answer:

| model | accuracy | correct | 95% interval |
|---|---|---|---|
| before training | {{ fmt(eval.before.accuracy) }} | {{ eval.before.correct }} / {{ eval.before.total }} | {{ interval(eval.before.ci95) }} |
| after training | **{{ fmt(eval.after.accuracy) }}** | {{ eval.after.correct }} / {{ eval.after.total }} | {{ interval(eval.after.ci95) }} |
{% endif %}{% if plot %}
![Reward per step and accuracy before/after training]({{ plot }})
{% endif %}
## Training procedure

{% if trackio_url %}[<img src="https://raw.githubusercontent.com/gradio-app/trackio/refs/heads/main/trackio/assets/badge.png" alt="Visualize in Trackio" title="Visualize in Trackio" width="150" height="24"/>]({{ trackio_url }})
{% endif %}{% if wandb_url %}[<img src="https://raw.githubusercontent.com/wandb/assets/main/wandb-github-badge-28.svg" alt="Visualize in Weights & Biases" width="150" height="24"/>]({{ wandb_url }})
{% endif %}Trained with `{{ trainer_class }}`{% if async_generation %}: generation runs in a background process while the trainer trains, and no rollout older than `max_staleness` = {{ max_staleness }} (optimizer steps) enters a loss{% endif %}. Loss: {{ loss_description }}.

### Configuration

| setting | value |
|---|---|
| reward functions | {{ rewards }} |
{% for key, value in config %}| `{{ key }}` | {{ value }} |
{% endfor %}
### Final metrics

| metric | value |
|---|---|
| optimizer steps | {{ global_step if global_step is not none else steps }} |
{% if eval %}| accuracy before → after | {{ fmt(eval.before.accuracy) }} → {{ fmt(eval.after.accuracy) }} ({{ signed(eval.gain) }}) |
{% endif %}{% if reward.gain is not none %}| mean reward, first → last quarter of steps | {{ fmt(reward.first_quarter) }} → {{ fmt(reward.last_quarter) }} ({{ signed(reward.gain) }}) |
{% endif %}{% if reward.final is not none %}| final reward (last logged step) | {{ fmt(reward.final) }} |
{% endif %}{% if train_runtime is not none %}| training time | {{ "%.0f" | format(train_runtime) }} s |
{% endif %}{% if metrics %}
Asynchronous-engine and loss metrics over the {{ steps }} logged steps:

| metric | mean | max | last |
|---|---|---|---|
{% for name, s in metrics %}| `{{ name }}` | {{ fmt(s.mean) }} | {{ fmt(s.max) }} | {{ fmt(s.last) }} |
{% endfor %}{% endif %}
### Framework versions

{% for name, v in versions %}- {{ name }}: {{ v }}
{% endfor %}
## Citations
{% for paper in papers %}
Cite {{ paper.name }} as:

```bibtex
{{ paper.citation }}
```
{% endfor %}
Cite TRL as:

```bibtex
{{ trl_citation }}
```
"""
