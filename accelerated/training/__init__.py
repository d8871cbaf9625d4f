"""Twin of [`reference.training`][reference.training]: a Llama's gradient and ggml-opt's
optimizer steps on MLX.

The gradient is ``mx.value_and_grad`` of the MLX training forward
([`accelerated.training.llama_grad`][accelerated.training.llama_grad]); AdamW and SGD are
ggml-opt's formulas as MLX ops ([`accelerated.training.opt`][accelerated.training.opt]);
[`accelerated.training.epoch`][accelerated.training.epoch] is ``llama_opt_epoch`` on both, and
[`accelerated.training.finetune`][accelerated.training.finetune] hands them to the fine-tune
driver. The schedule, the dataset, the results and the parameter filter are the reference's,
imported.
"""
