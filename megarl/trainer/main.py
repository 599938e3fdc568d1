"""Entry point of the main job: ``python -m megarl.trainer.main --config configs/grpo_tiny.yaml [a.b.c=value ...]``.

Builds everything the loop needs from a :class:`MegarlConfig` — tokenizer, datasets, reward manager, the
workers' roles (:func:`megarl.controller.roles.start_workers`: a Ray cluster, local or attached with
``trainer.ray_address``, its resource pools and worker groups), loggers and the checkpoint manager — then
runs :class:`megarl.trainer.loop.RLTrainer`. ``run(cfg)`` is the programmatic form (used by
``launch/multinode.py`` and the end-to-end tests).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Optional, Sequence

from megarl.config import MegarlConfig
from megarl.run_config import load_config
from megarl.config.loader import given_keys, to_dict
from megarl.config.paths import with_absolute_paths
from megarl.config.verl_keys import defaulted_usual_keys
from megarl.engines.megatron.expected_warnings import explanation, hide_expected_warnings
from megarl.trainer.agent_rollout import build_agent_rollout
from megarl.trainer.loop import RLTrainer
from megarl.trainer.memory_check import check_memory_plan, plan_run, plannable, this_gpu_gib
from megarl.trainer.resume_guard import check_resume, resume_point, save_run_config
from megarl.trainer.scoring import SampleScorer
from megarl.trainer.run_lock import RunLock
from megarl.trainer.stop_signals import StopSignals


def build_data(cfg: MegarlConfig, tokenizer, tools: Optional[dict] = None, vision=None):
    """The train loader and the validation dataset; ``vision``: a vision-language policy's image tokens."""
    from megarl.data.dataset import RLDataset
    from megarl.data.sampler import PromptLoader
    from megarl.data.synthetic import resolve_data_files

    d = cfg.data

    def dataset(files, split):
        return RLDataset(resolve_data_files(files, split=split), tokenizer, prompt_key=d.prompt_key,
                         image_key=d.image_key, max_prompt_length=d.max_prompt_length,
                         filter_overlong_prompts=d.filter_overlong_prompts,
                         truncation=d.truncation, apply_chat_template=d.apply_chat_template,
                         tools=[tool.schema for tool in tools.values()] if tools else None, vision=vision)

    train = dataset(d.train_files, "train")
    loader = PromptLoader(train, d.train_batch_size, seed=d.seed, shuffle=d.shuffle)
    val = dataset(d.val_files, "val") if d.val_files else None
    return loader, val


def build_reward_manager(cfg: MegarlConfig):
    from megarl.rewards import RewardManager, load_custom_reward_fn

    from megarl.rewards.remote import RemoteRewardClient

    custom = cfg.reward_model.custom_function
    custom_fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    r = cfg.reward_model.remote
    remote = (RemoteRewardClient(r.url, batch_size=r.batch_size, max_concurrency=r.max_concurrency,
                                 timeout_s=r.timeout_s, max_retries=r.max_retries, backoff_s=r.backoff_s)
              if r.url else None)
    return RewardManager(custom_fn=custom_fn, on_error=cfg.reward_model.on_error,
                         max_error_fraction=cfg.reward_model.max_error_fraction, remote=remote)


def build_rm_inputs(cfg: MegarlConfig, policy_tokenizer):
    """The reward model's input builder (its own tokenizer), or None without a reward model."""
    from transformers import AutoTokenizer

    from megarl.models.embedded import resolve_model_path
    from megarl.rewards.model_inputs import RewardModelInputs

    rm = cfg.reward_model
    if not rm.enable:
        return None
    rm_tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(rm.model.path)))
    if rm.model.input_tokenizer:  # verl's switch: decode with this tokenizer, re-tokenize with the RM's template
        policy_tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(rm.model.input_tokenizer)))
    return RewardModelInputs(policy_tokenizer, rm_tokenizer, max_length=rm.max_length,
                             retokenize=True if rm.model.input_tokenizer else None)


def check_teacher_tokenizers(cfg: MegarlConfig, tokenizer) -> None:
    """Distillation compares log-probs of the same token ids: a teacher whose tokenizer maps text to other ids
    than the student's is refused here, naming it, instead of training toward nonsense."""
    from transformers import AutoTokenizer

    from megarl.config import ConfigError
    from megarl.models.embedded import resolve_model_path

    if not cfg.distillation.enabled:
        return
    student = tokenizer.get_vocab()
    for name, teacher in cfg.distillation.teacher_models.items():
        vocab = AutoTokenizer.from_pretrained(str(resolve_model_path(teacher.model_path))).get_vocab()
        differing = sorted(token for token in set(student) | set(vocab) if student.get(token) != vocab.get(token))
        if differing:
            raise ConfigError(
                f"distillation.teacher_models.{name}: its tokenizer ({teacher.model_path}) is not the student's "
                f"({cfg.actor_rollout_ref.model.tokenizer_path or cfg.actor_rollout_ref.model.path}): "
                f"{len(differing)} token(s) map to other ids or are missing, e.g. {differing[:5]}; on-policy "
                f"distillation compares log-probs of the same token ids, so teacher and student must share one")


def start_up_summary(cfg: MegarlConfig, out_dir: Path, resume_from: Optional[Path], total_steps: int) -> str:
    """Where this run writes, and whether it continues an earlier one: the first lines a user reads."""
    t = cfg.trainer
    saves = (f"every {t.save_freq} steps and at the end" if t.save_freq > 0
             else "only on SIGTERM/SIGUSR1: trainer.save_freq=-1")
    resume = (f"resumes {resume_from}" if resume_from is not None
              else "starts afresh" + (" (trainer.resume_mode=disable)" if t.resume_mode == "disable" else ""))
    steps = f"{total_steps} step{'' if total_steps == 1 else 's'}"
    return (f"run {t.project_name}/{t.experiment_name}: {steps}, {resume}\n"
            f"  outputs:     {out_dir} (config.yaml, metrics, error.log)\n"
            f"  checkpoints: {out_dir / 'checkpoints'} ({saves})")


def vision_language_policy(cfg: MegarlConfig, model_path):
    """The policy's :class:`~megarl.data.vision_inputs.VisionTokens` when it is a vision-language model (None for a
    text model), after refusing, before anything starts, what megarl does not run with images yet (context
    and sequence parallelism)."""
    from megarl.config import ConfigError
    from megarl.data.vision_inputs import VisionTokens

    vision = VisionTokens.of_model(model_path) if Path(model_path).is_dir() else None
    if vision is None:
        return None
    # the images' M-RoPE positions and slots are laid out per whole sequence, and the embedding that takes the image
    # features is whole on every rank: context- and sequence-parallel ranks hold pieces of it
    blocks = {"actor_rollout_ref.actor.megatron": cfg.actor_rollout_ref.actor.megatron}
    if cfg.critic.enable:
        blocks["critic.megatron"] = cfg.critic.megatron
    refused = [f"{prefix}.context_parallel_size={m.context_parallel_size}" for prefix, m in blocks.items()
               if m.context_parallel_size > 1]
    refused += [f"{prefix}.sequence_parallel=true" for prefix, m in blocks.items() if m.sequence_parallel]
    if refused:
        raise ConfigError(f"actor_rollout_ref.model.path={str(model_path)!r} is a vision-language model; megarl "
                          f"trains one without context or sequence parallelism so far: not with "
                          f"{'; '.join(refused)}")
    return vision


def run(cfg: MegarlConfig) -> list[dict]:
    """Train to the end of ``cfg``; returns the per-step metric history."""
    from transformers import AutoTokenizer

    from megarl.agents.tools import load_tools
    from megarl.controller.roles import start_workers
    from megarl.models.embedded import resolve_model_path
    from megarl.trainer.checkpoint import CheckpointManager
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.trackers import check_trackers_installed, open_trackers

    cfg = with_absolute_paths(cfg, Path.cwd())  # the workers' working directories differ from the driver's
    t = cfg.trainer
    check_trackers_installed(t.logger)  # before minutes of data loading, not after
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path)
    vision = vision_language_policy(cfg, model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.actor_rollout_ref.model.tokenizer_path or model_path))
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(multi_turn.tool_config_path) if multi_turn.enable else None
    check_teacher_tokenizers(cfg, tokenizer)
    train_loader, val_dataset = build_data(cfg, tokenizer, tools, vision=vision)
    total_steps = t.total_training_steps or len(train_loader) * t.total_epochs
    reward_manager = build_reward_manager(cfg)
    out_dir = Path(t.default_local_dir)
    lock = RunLock(out_dir)  # before anything is written there
    stop = StopSignals()
    workers = None
    logger = None
    agent_rollout = None
    try:
        checkpoints = CheckpointManager(out_dir / "checkpoints", max_to_keep=t.max_ckpt_to_keep)
        resume_from = resume_point(cfg, checkpoints)
        check_resume(cfg, resume_from, total_steps)
        check_memory_plan(cfg)  # a run that cannot fit is refused here, not in step 1
        save_run_config(cfg, out_dir)
        print(start_up_summary(cfg, out_dir, resume_from, total_steps), flush=True)
        note = explanation()
        if note is not None:
            print(f"  note:        {note}", flush=True)
        logger = MetricsLogger(t.logger, out_dir, trackers=open_trackers(
            t.logger, project=t.project_name, experiment=t.experiment_name, config=to_dict(cfg), log_dir=out_dir,
            resuming=resume_from is not None))
        workers = start_workers(cfg, total_steps=total_steps)
        workers.profiler = cfg.global_profiler
        if tools is not None:  # every response a conversation with the tools (validation's too)
            agent_rollout = build_agent_rollout(cfg, workers.rollout, tokenizer, tools)
        scorer = SampleScorer(cfg, tokenizer=tokenizer, reward_manager=reward_manager, rollout=workers.rollout,
                              reward_model=workers.reward_model, rm_inputs=build_rm_inputs(cfg, tokenizer))
        trainer = RLTrainer(cfg, tokenizer=tokenizer, train_loader=train_loader, val_dataset=val_dataset,
                            scorer=scorer, actor=workers.actor, critic=workers.critic, teachers=workers.teachers,
                            rollout=agent_rollout or workers.rollout, logger=logger,
                            checkpoints=checkpoints,
                            total_steps=total_steps, stop_requested=lambda: stop.requested,
                            profiled_step=workers.profiled_step)
        with stop:
            return trainer.fit()
    finally:
        if logger is not None:
            logger.close()
        if agent_rollout is not None:
            agent_rollout.close()
        if workers is not None:
            workers.shutdown()
        lock.release()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.trainer.main", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML recipe (see configs/); defaults apply without one")
    parser.add_argument("--validate-only", action="store_true",
                        help="load, fill and check the config, plan its memory where the model has an HF config, "
                             "and exit (0: valid and fits) without starting anything")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")
    return parser.parse_args(argv)


def validate_only(cfg: MegarlConfig) -> int:
    """What ``--validate-only`` prints: the config is valid (it loaded), and where it can be planned, the plan
    (for this machine's GPU, or an 80 GiB one)."""
    t = cfg.trainer
    print(f"config valid: {t.project_name}/{t.experiment_name}, outputs in {t.default_local_dir}")
    if not plannable(cfg):
        print(f"not planned: actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path} has no HF config.json")
        return 0
    report = plan_run(cfg, gpu_memory_gib=this_gpu_gib() or 80.0)
    print(report.table())
    return 0 if report.fits else 1


def cli(argv: Optional[Sequence[str]] = None) -> int:
    from megarl.config import ConfigError

    args = parse_args(argv)
    hide_expected_warnings()
    try:
        cfg = load_config(args.config, args.overrides)
        defaulted = defaulted_usual_keys(cfg, given_keys(args.config, args.overrides))
        if defaulted:
            print("defaults in use for keys verl users usually set: " + ", ".join(defaulted), flush=True)
        if args.validate_only:
            return validate_only(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except ConfigError as exc:  # found at start-up: resuming another run, a plan that does not fit
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # bad data, a failing reward, a full disk, a dead worker: one line, traceback filed
        log = Path(cfg.trainer.default_local_dir) / "error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(f"error: {type(exc).__name__}: {first_line[:2000]}\n(full traceback: {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
