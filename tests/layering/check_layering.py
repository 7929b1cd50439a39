#!/usr/bin/env python3
"""Checks pdserve's include and link layering against tests/layering/rules.txt.

usage: check_layering.py [REPO_ROOT]   (default: two levels above this file)

Prints every violation as FILE:LINE: message and exits 1 if there is any,
0 otherwise. Only the repository's own source folders are scanned (build
trees, node_modules and hidden folders are skipped).
"""
import os
import re
import sys

SOURCE_EXT = ('.cc', '.h', '.cu', '.cuh', '.cpp', '.hpp')
SKIP_DIRS = {'build', 'node_modules', '__pycache__'}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
FLAG_RE = re.compile(r'\bABSL_(?:DECLARE_)?FLAG\s*\(')
ADD_LIB_RE = re.compile(r'add_(?:library|executable)\s*\(\s*([A-Za-z0-9_]+)')
LINK_RE = re.compile(r'target_link_libraries\s*\(\s*([A-Za-z0-9_]+)([^)]*)\)', re.S)


def parse_rules(path):
    rules = {'include': {}, 'link': {}, 'flags': [], 'rooted': False}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split('#', 1)[0].strip()
            if not line:
                continue
            words = line.split()
            kind = words[0]
            if kind in ('include', 'link'):
                if len(words) < 3 or not all(w.startswith('!') for w in words[2:]):
                    sys.exit(f'{path}:{n}: expected "{kind} NAME !DEP ..."')
                rules[kind][words[1]] = {w[1:] for w in words[2:]}
            elif kind == 'flags':
                rules['flags'] = [w.rstrip('/') for w in words[1:]]
            elif kind == 'rooted':
                rules['rooted'] = True
            else:
                sys.exit(f'{path}:{n}: unknown rule "{kind}"')
    return rules


def source_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames
                       if not d.startswith('.') and d not in SKIP_DIRS
                       and not d.startswith('build-')]
        if rel_dir == '.':
            continue
        for name in filenames:
            if name.endswith(SOURCE_EXT):
                yield os.path.normpath(os.path.join(rel_dir, name))


def top_folder(rel):
    return rel.split(os.sep, 1)[0]


def check_sources(root, rules):
    errors = []
    top_dirs = {d for d in os.listdir(root)
                if os.path.isdir(os.path.join(root, d)) and not d.startswith('.')}
    for rel in sorted(source_files(root)):
        folder = top_folder(rel)
        denied = rules['include'].get(folder, set())
        with open(os.path.join(root, rel), errors='replace') as f:
            for n, line in enumerate(f, 1):
                m = INCLUDE_RE.match(line)
                if m:
                    inc = m.group(1)
                    if rules['rooted'] and (inc.startswith('../') or '/../' in inc):
                        errors.append(f'{rel}:{n}: include "{inc}" is not rooted at the repository')
                    dep = inc.split('/', 1)[0] if '/' in inc else None
                    if dep is not None and dep != folder:
                        own = dep in top_dirs or dep == 'pdserve'
                        if own and ('*' in denied or dep in denied):
                            errors.append(
                                f'{rel}:{n}: {folder}/ may not include "{inc}" '
                                f'(rule: include {folder} !{"*" if "*" in denied else dep})')
                if FLAG_RE.search(line) and not line.lstrip().startswith('//'):
                    if not any(rel == p or rel.startswith(p + os.sep) for p in rules['flags']):
                        errors.append(f'{rel}:{n}: flags are defined only in '
                                      f'{", ".join(rules["flags"])} (rule: flags)')
    return errors


def link_graph(root):
    graph = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if not d.startswith('.') and d not in SKIP_DIRS
                       and not d.startswith('build-')]
        if 'CMakeLists.txt' not in filenames:
            continue
        text = open(os.path.join(dirpath, 'CMakeLists.txt')).read()
        text = re.sub(r'#[^\n]*', '', text)
        for m in ADD_LIB_RE.finditer(text):
            graph.setdefault(m.group(1), set())
        for m in LINK_RE.finditer(text):
            deps = {w for w in m.group(2).split()
                    if w not in ('PUBLIC', 'PRIVATE', 'INTERFACE')}
            graph.setdefault(m.group(1), set()).update(deps)
    return graph


def check_links(root, rules):
    graph = link_graph(root)
    errors = []
    for target, denied in sorted(rules['link'].items()):
        if target not in graph:
            errors.append(f'rules.txt: link rule names unknown target {target}')
            continue
        # Depth-first walk keeping one path per reached target, for the message.
        paths = {target: [target]}
        stack = [target]
        while stack:
            t = stack.pop()
            for d in sorted(graph.get(t, ())):
                if d not in paths:
                    paths[d] = paths[t] + [d]
                    stack.append(d)
        for bad in sorted(denied & paths.keys()):
            errors.append(f'CMake: {target} links {bad} via {" -> ".join(paths[bad])} '
                          f'(rule: link {target} !{bad})')
    return errors


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, '..', '..'))
    rules = parse_rules(os.path.join(here, 'rules.txt'))
    errors = check_sources(root, rules) + check_links(root, rules)
    for e in errors:
        print(e)
    print(f'layering: {len(errors)} violation(s)', file=sys.stderr)
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
