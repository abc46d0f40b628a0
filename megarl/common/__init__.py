"""Generic helpers every program may use: error types shared by the library and the CLIs, the
command-line scaffolding, optional dependencies (compat), network addresses and process groups,
signals and owned children, run logs, the step timeline, bounded config fields, safe arithmetic for
rewards, plots, megatron-core's first import made lighter (megatron_import, run by `import
megarl`). Nothing here knows about trainer ranks, the rollout manager or the servers; a
module here imports only the standard library, third-party packages and other modules of this
package."""
