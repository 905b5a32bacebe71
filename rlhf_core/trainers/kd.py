"""Knowledge distillation (OpenRLHF's `train_kd`): the student learns the data's responses and the
teacher's whole next-token distribution at each of their tokens.

Per response token: `(1 - kd_coef) x NLL + kd_coef x cross-entropy to the teacher's distribution`
(`algos.losses.distillation_losses`), summed and divided by the step's response tokens as in SFT,
so micro-batching does not change it. The frozen teacher runs without grad at the same positions
(the lean forward's loss-position head for both: no `(rows, T, vocab)` logits are formed). The
teacher must share the student's vocabulary (checked when it loads).

One difference from OpenRLHF 0.9: there the distillation term is read at positions shifted by one
from the NLL's (the token after each response token, the first response token left out); here both
terms are on the logits that predict each response token.
"""

from __future__ import annotations

import torch

from rlhf_core.algos.losses import distillation_losses
from rlhf_core.config import KDConfig
from rlhf_core.distributed.engine import EngineSettings, initialize_frozen
from rlhf_core.infra.settings import ConfigError
from rlhf_core.models.forward import loss_logits
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, model_options
from rlhf_core.trainers.common import local_model_path
from rlhf_core.trainers.sft import SFTRecipe
from rlhf_core.trainers.sft import load_data as load_data  # the same examples as SFT


def output_size(model) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_output_embeddings().weight.shape[0]


class KDRecipe(SFTRecipe):
    cfg: KDConfig

    def setup(self, data=None) -> None:
        super().setup(data)
        cfg = self.cfg
        teacher = load_causal_lm(local_model_path(cfg.teacher_pretrain), **model_options(cfg.ds))
        student_vocab, teacher_vocab = output_size(self.engine.module), output_size(teacher)
        if student_vocab != teacher_vocab:
            raise ConfigError(f"--teacher_model {cfg.teacher_pretrain}: its vocabulary has {teacher_vocab} tokens, the "
                              f"student's (--pretrain {cfg.pretrain}) {student_vocab}: distillation needs one tokenizer")
        if load_tokenizer(local_model_path(cfg.teacher_pretrain)).get_vocab() != self.data.tokenizer.get_vocab():
            raise ConfigError(f"--teacher_model {cfg.teacher_pretrain}: its tokenizer maps tokens to other ids than "
                              f"the student's (--pretrain {cfg.pretrain}): distillation needs one tokenizer")
        self.teacher = initialize_frozen(teacher, EngineSettings.of(cfg), offload=cfg.teacher.offload)

    def micro_step(self, model, examples):
        batch = self.to_batch([e.seq for e in examples])
        targets, logits = loss_logits(model, batch)
        with torch.no_grad():
            _, teacher_logits = loss_logits(self.teacher, batch)
        labels = batch.input_ids.reshape(-1)[targets]
        weights = batch.loss_mask.reshape(-1)[targets]
        nll, distill = distillation_losses(logits, teacher_logits, labels, weights)
        coef = self.cfg.model.kd_coef
        loss = (1 - coef) * nll + coef * distill
        stats = {"loss": loss.detach(), "nll": nll.detach(), "distill_loss": distill.detach()}
        return loss, stats, int((batch.seq_ids >= 0).sum())

    def inputs(self) -> dict:
        return {**super().inputs(), "teacher_model": self.cfg.teacher_pretrain}
