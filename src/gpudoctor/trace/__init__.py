"""``gpudoctor trace``: the runtime probe. Importing this package does not import torch;
its submodules do, so only ``gpudoctor trace`` / ``gpudoctor.watch`` pay for it."""
