"""What a measurement is asked, checked before any work: the workflow config and a door's inputs.

The workflow config loaded and checked across its keys (:mod:`~kvdiverge.config.workflow`),
the frontier's grid and points (:mod:`~kvdiverge.config.frontier`), the task blocks
(:mod:`~kvdiverge.config.task_checks`), the layers a model's files say a press cannot run on
(:mod:`~kvdiverge.config.layers`), the prompts, presses and model argument a door is given
(:mod:`~kvdiverge.config.inputs`), and what each output was made with
(:mod:`~kvdiverge.config.provenance`). One setting's own rules live in
:mod:`kvdiverge.settings`.
"""
