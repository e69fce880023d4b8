"""VERL's own checks on `python -m verl.trainer.main_ppo OVERRIDES...`, without a GPU or a Ray
cluster: the Hydra config main_ppo composes (an override naming a key VERL does not have is refused
there), resolved as main_ppo resolves it, then the trainer's `_validate_config`, given the two facts
RayPPOTrainer derives before it calls it. Run with VERL 0.5.0 on the path (make venv puts it in
.venv/verl-check): `python tests/verl_config_check.py OVERRIDE...`."""

import sys
from types import SimpleNamespace

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from verl.trainer.ppo.ray_trainer import AdvantageEstimator, RayPPOTrainer

with initialize_config_module("verl.trainer.config", version_base=None):
    config = compose("ppo_trainer", overrides=sys.argv[1:])
OmegaConf.resolve(config)
# main_ppo adds the reference policy's workers for a KL loss or in-reward KL; only GAE needs a critic.
reference = config.algorithm.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss
critic = config.algorithm.adv_estimator == AdvantageEstimator.GAE
RayPPOTrainer._validate_config(SimpleNamespace(config=config, use_reference_policy=reference, use_critic=critic))
