"""OpenAI's Batch API on the router: files of requests run at the lowest priority in the fleet's idle capacity.

- :mod:`.store`: files and batches on a local directory (durable across a restart; 0600 files, 0700 dirs);
- :mod:`.lines`: an input file's lines parsed, and the output and error lines OpenAI's format writes;
- :mod:`.runner`: each batch's lines through the router's own request path, a few in flight at once;
- :mod:`.api`: the HTTP routes (``/v1/files``, ``/v1/batches``), each owner's objects visible to it alone.
"""
