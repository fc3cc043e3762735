# dlrover-hpc's own config for nanoGPT's train.py (not upstream's): a tiny model on the CPU,
# resuming from out_dir/ckpt.pt whenever one is there (a restarted worker finds it).
out_dir = 'out-tiny'
dataset = 'tiny'
init_from = 'resume' if os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else 'scratch'
device = 'cpu'
backend = 'gloo'
dtype = 'float32'
compile = False
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32
batch_size = 4
dropout = 0.0
gradient_accumulation_steps = 2
max_iters = 60
lr_decay_iters = 60
warmup_iters = 5
eval_interval = 20
eval_iters = 2
log_interval = 1
always_save_checkpoint = True
