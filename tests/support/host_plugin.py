"""The plugin installed on a machine without CUDA, for tests of what sits on top of it (the engine
routes, release and reserve): the real C core, configured as ``alloc.install`` configures it but
serving every device from host memory (``host_memory``), and ``alloc.plugin`` told it is installed.
PyTorch is left alone, so no tensor goes through it; the workspace arena and its statistics are the
core's own. The engine conformance suite loads this file by path in each engine's environment."""


def install_on_host(config, scope: str = "process") -> None:
    from alloc import plugin
    from alloc._lib import ffi, lib
    c = ffi.new("ia_plugin_config_t *")
    chosen = plugin._SCOPE_TYPES[scope]()
    c.scope = chosen.code
    c.budget, c.alignment, c.unified, c.host_memory, c.expandable = config.budget_bytes, 256, 0, 1, 0
    if lib.ia_plugin_configure(c) != lib.IA_OK:
        raise RuntimeError("the C core refused the configuration: a device already has arenas")
    plugin._installed = plugin._Installed(config, chosen, (c,))
