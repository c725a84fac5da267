"""The Triton backend: routing (`routes`, a pure function of the call's spec), tile tables (`configs`),
launchers (`attention`, `gluon`, `block_sparse`, `decode`, `merge`) and launch plans (`launch`). Its `entry`
module is what the ops call; importing this package alone loads no kernel."""
