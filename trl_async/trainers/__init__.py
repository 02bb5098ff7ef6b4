"""The trainers: `engine` (the rollout engine's side of a TRL trainer, shared), `grpo` and `ppo` (their losses),
`critic` (PPO's value models), `forward` (the shared-prompt training forward), `rollout_spec` (what the generation
process is told), `trl_contract` (everything assumed of TRL's private API).

Imported by name (`trl_async.trainers.grpo`), not here: the generation process and the configs import parts of this
package without TRL's trainers.
"""
