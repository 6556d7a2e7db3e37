"""What a pass returns: ``FusedOutput`` (the base's logits and each task's, cut lazily when read)
and ``OutputIndex``/``PairIndex``/``Answers`` (where each asked task's rows lie in a planned pass's
flat logits, and a request's answers read from them).

May import: ``memory_core.errors``, ``weights``, ``sets``. A plan is read through the
``PlannedOutputs`` protocol, so this room sits below ``routing``, which builds both.
"""
