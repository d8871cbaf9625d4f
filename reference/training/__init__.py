r"""Training as llama.cpp does it: backward ops, a Llama's gradient, and ggml-opt.

llama.cpp fine-tunes a model with ``llama_opt_init`` / ``llama_opt_epoch``
(``src/llama-context.cpp``) on top of ggml-opt (``ggml/src/ggml-opt.cpp``), driven by
``examples/training/finetune.cpp``. The specification follows the same split:

- [`reference.training.grad`][reference.training.grad]: the backward of every op the Llama
  forward uses, one function per ``ggml_compute_backward`` rule, named after ggml's backward op;
- [`reference.training.llama_grad`][reference.training.llama_grad]: the forward of one
  datapoint as the training graph runs it, recording what the backward needs, and the
  chain rule written out block by block;
- [`reference.training.opt`][reference.training.opt]: the trainable-parameter filter,
  ggml-opt's AdamW and SGD steps, and gradient accumulation over ``opt_period`` ubatches;
- [`reference.training.schedule`][reference.training.schedule]: the learning rate per epoch
  (``-lr``, ``-lr-min``, ``-decay-epochs``);
- [`reference.training.dataset`][reference.training.dataset]: datapoints cut from a text with
  stride ``n_ctx / 2`` and the train/validation split;
- [`reference.training.result`][reference.training.result]: the loss and accuracy with their
  uncertainties, and the progress line;
- [`reference.training.epoch`][reference.training.epoch]: ``llama_opt_epoch``, the loop that
  puts them together;
- [`reference.training.finetune`][reference.training.finetune]: ``finetune``'s main loop,
  written once over both twins (a [`Trainer`][reference.training.finetune.Trainer] each);
- [`reference.training.save`][reference.training.save]: ``llama_model_save_to_file``, the
  trained model as a GGUF llama.cpp loads.
"""
