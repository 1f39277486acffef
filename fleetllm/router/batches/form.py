"""A ``multipart/form-data`` body (what ``POST /v1/files`` receives) split into its fields; stdlib only."""

from __future__ import annotations

from email.message import Message
from email.parser import BytesHeaderParser

from fleetllm.server.protocol import APIError


def parse_form(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """Each field's name -> (file name or None, bytes); a 400 ``APIError`` for a body that is no form."""
    ctype = Message()
    ctype["content-type"] = content_type
    boundary = ctype.get_param("boundary")
    if ctype.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) or not boundary:
        raise APIError(400, "the body must be multipart/form-data with a boundary")
    fields: dict[str, tuple[str | None, bytes]] = {}
    # every part follows CRLF--boundary (the first one too, once a CRLF is put before the body)
    for part in (b"\r\n" + body).split(b"\r\n--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, data = part.partition(b"\r\n\r\n")
        headers = BytesHeaderParser().parsebytes(head.lstrip(b"\r\n") + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if not sep or not isinstance(name, str):
            raise APIError(400, "a form part lacks its Content-Disposition name")
        filename = headers.get_filename()
        fields[name] = (filename, data)
    return fields
