"""mkdocs hooks (mkdocs.yml `hooks:`).

- A page's `<!-- metrics_table() -->` becomes the table of logged metrics, rendered from
  `hf_cfp.names.LOGGED_METRICS` by `metrics_table()`, the one registry of the `cfp/*` keys (the README holds the
  same rendering, checked by tests/unit/test_names.py).
- README.md and CONTRIBUTING.md are not pages of the site, but they link into it: after the build, every relative
  link in them must name a file of the repository, and a link into docs/ with `#anchor` a heading of that page; a
  broken one is a warning, so `mkdocs build --strict` fails on it as on a broken link between pages.
"""

import logging
import re
from pathlib import Path

from hf_cfp.names import metrics_table

PLACEHOLDER = "<!-- metrics_table() -->"
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of a markdown link [text](target)
ROOT_PAGES = ("README.md", "CONTRIBUTING.md")
log = logging.getLogger("mkdocs.hooks.links")
anchors: dict[str, set[str]] = {}  # page source path (docs/-relative) -> the ids of its headings


def on_page_markdown(markdown: str, **kwargs) -> str:
    return markdown.replace(PLACEHOLDER, metrics_table())


def on_page_content(html: str, page, **kwargs) -> str:
    anchors[page.file.src_uri] = set(_ids(page.toc))
    return html


def on_post_build(config, **kwargs) -> None:
    root = Path(config.config_file_path).parent
    docs = Path(config.docs_dir).relative_to(root).as_posix() + "/"
    for name in ROOT_PAGES:
        for target in LINK.findall((root / name).read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # an absolute URL (not checked: the build is offline) or an anchor of the file itself
            path, _, anchor = target.partition("#")
            if not (root / path).exists():
                log.warning(f"{name} links to {target!r}, but {path!r} does not exist.")
            elif anchor and path.startswith(docs) and anchor not in anchors.get(path.removeprefix(docs), set()):
                log.warning(f"{name} links to {target!r}, but {path!r} has no heading with the id {anchor!r}.")


def _ids(toc):
    for item in toc:
        yield item.id
        yield from _ids(item.children)
