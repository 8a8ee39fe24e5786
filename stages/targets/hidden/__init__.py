"""The hidden-state family: how a teacher's ``[B, L, d]`` states are coded on the device and what the student's
hidden loss is.

* ``device_codecs``: the hidden codecs (``storage.hidden_codecs``, their numpy reference and on-disk arrays) on torch
  tensors: stage one's ``encode`` before the copy to the host, stage two's ``decode_batch`` after the copy to its
  device. A new codec is a module of ``storage/hidden_codecs/`` (storage must read every cache alone); its torch
  side needs nothing here unless it adds an operation to ``TorchOps``.
* ``hidden_losses``: the ``--hidden-loss`` registry, one ``HiddenLoss`` object per loss, and stage two's hidden
  flags as the family's option groups (``HiddenLossFlags``: ``--hidden-loss``; ``CriticFlags``: wgan's critic),
  held by ``LossOptions``; torch-free, so that the option classes and ``kdcache train --help`` list the losses
  without torch.
* ``loss_terms`` (MSE, cosine, CKA) and ``wgan`` (the critic and its trainer): the losses' torch functions, which
  the registry names as ``"module:function"`` and imports on the first loss. A new loss is a function here and one
  ``register_hidden_loss`` line in ``hidden_losses``.
"""
