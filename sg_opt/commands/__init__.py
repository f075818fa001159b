"""The `sg-opt` commands, one module each; ``sg_opt.cli`` registers them in the order `--help` lists them."""
