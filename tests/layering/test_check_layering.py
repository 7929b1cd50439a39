"""The layering check must fail on each kind of violation (and pass clean)."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, 'check_layering.py')


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write(text)


class CheckLayeringTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name
        # A minimal tree that obeys every rule in rules.txt.
        for folder in ('common', 'kernels', 'tokenizer', 'structured', 'kv_cache', 'model', 'engine', 'wire',
                       'kv_transfer', 'prefill_service', 'decode_service', 'worker', 'router',
                       'cli'):
            write(self.root, f'{folder}/x.h', f'#include "{folder}/y.h"\n')
        write(self.root, 'engine/e.cc', '#include "kernels/k.h"\n#include "common/c.h"\n')
        write(self.root, 'router/r.cc', '#include "wire/enums.h"\n#include "tokenizer/tokenizer.h"\n'
                                        '#include "kv_cache/block_manager.h"\n')
        write(self.root, 'model/m.cc', '#include "kv_cache/kv_cache.h"\n#include "tokenizer/tokenizer.h"\n')
        write(self.root, 'kv_cache/c.cc', '#include "kernels/cpu/paged_attention.h"\n')
        write(self.root, 'cli/f.cc', 'ABSL_FLAG(int, x, 0, "x");\n')
        self.cmake = {
            'router/CMakeLists.txt': 'add_library(pdserve_router STATIC r.cc)\n'
                                     'target_link_libraries(pdserve_router PUBLIC pdserve_wire '
                                     'pdserve_tokenizer pdserve_kv_cache_base)\n',
            'wire/CMakeLists.txt': 'add_library(pdserve_wire STATIC w.cc)\n'
                                   'target_link_libraries(pdserve_wire PUBLIC pdserve_sampling)\n',
            'tokenizer/CMakeLists.txt': 'add_library(pdserve_tokenizer STATIC t.cc)\n',
            'structured/CMakeLists.txt': 'add_library(pdserve_structured STATIC s.cc)\n'
                                         'target_link_libraries(pdserve_structured PUBLIC '
                                         'pdserve_tokenizer)\n',
            'kv_cache/CMakeLists.txt': 'add_library(pdserve_kv_cache_base STATIC b.cc)\n'
                                       'add_library(pdserve_kv_cache STATIC c.cc)\n'
                                       'target_link_libraries(pdserve_kv_cache PUBLIC '
                                       'pdserve_kv_cache_base pdserve_kernels_cpu)\n',
            'model/CMakeLists.txt': 'add_library(pdserve_model STATIC m.cc)\n'
                                    'target_link_libraries(pdserve_model PUBLIC pdserve_kv_cache '
                                    'pdserve_tokenizer)\n',
            'engine/CMakeLists.txt': 'add_library(pdserve_sampling STATIC s.cc)\n'
                                     'add_library(pdserve_engine STATIC e.cc)\n'
                                     'target_link_libraries(pdserve_engine PUBLIC pdserve_model '
                                     'pdserve_sampling pdserve_kernels_cpu)\n',
            'prefill_service/CMakeLists.txt': 'add_library(pdserve_prefill_service STATIC p.cc)\n',
            'decode_service/CMakeLists.txt': 'add_library(pdserve_decode_service STATIC d.cc)\n'
                                             'target_link_libraries(pdserve_decode_service PUBLIC pdserve_engine)\n',
        }
        for rel, text in self.cmake.items():
            write(self.root, rel, text)

    def tearDown(self):
        self.tmp.cleanup()

    def run_check(self):
        p = subprocess.run([sys.executable, CHECK, self.root], capture_output=True, text=True)
        return p.returncode, p.stdout

    def test_clean_tree_passes(self):
        rc, out = self.run_check()
        self.assertEqual(rc, 0, out)

    def test_common_including_anything_of_pdserve_fails(self):
        write(self.root, 'common/bad.h', '#include "pdserve/v1/router.pb.h"\n')
        rc, out = self.run_check()
        self.assertEqual(rc, 1)
        self.assertIn('common/bad.h:1', out)

    def test_each_denied_include_fails(self):
        cases = [('kernels/k.cc', 'engine/engine.h'),
                 ('engine/e2.cc', 'kv_transfer/transport.h'),
                 ('kv_transfer/t.cc', 'router/router_service.h'),
                 ('prefill_service/p.cc', 'decode_service/decode_handler.h'),
                 ('decode_service/d.cc', 'prefill_service/prefill_handler.h'),
                 ('router/r2.cc', 'decode_service/decode_handler.h'),
                 ('router/r3.cc', 'kernels/cpu/ops.h'),
                 # The folders split out of the engine keep their direction:
                 # tokenizer uses common only, kv_cache knows no model, model
                 # no engine, and the router reaches neither model nor engine.
                 ('tokenizer/t.cc', 'kv_cache/block_manager.h'),
                 ('tokenizer/t2.cc', 'kernels/cpu/ops.h'),
                 ('kv_cache/c2.cc', 'model/model_config.h'),
                 ('kv_cache/c3.cc', 'tokenizer/tokenizer.h'),
                 ('model/m2.cc', 'engine/engine.h'),
                 ('kernels/k2.cc', 'kv_cache/kv_cache.h'),
                 ('router/r4.cc', 'model/model_config.h'),
                 ('router/r5.cc', 'engine/sampling.h'),
                 ('wire/w2.cc', 'kv_cache/block_manager.h'),
                 # Constraints know tokens, not models, engines or roles.
                 ('structured/s1.cc', 'engine/sampling.h'),
                 ('structured/s2.cc', 'model/model_config.h'),
                 ('structured/s3.cc', 'router/openai/request.h')]
        for rel, inc in cases:
            with self.subTest(rel=rel, inc=inc):
                write(self.root, rel, f'#include "{inc}"\n')
                rc, out = self.run_check()
                self.assertEqual(rc, 1, out)
                self.assertIn(f'{rel}:1', out)
                os.remove(os.path.join(self.root, rel))

    def test_flag_outside_cli_fails(self):
        write(self.root, 'engine/flagged.cc', 'ABSL_FLAG(int, y, 0, "y");\n')
        rc, out = self.run_check()
        self.assertEqual(rc, 1)
        self.assertIn('engine/flagged.cc:1', out)

    def test_relative_include_fails(self):
        write(self.root, 'worker/w.cc', '#include "../common/c.h"\n')
        rc, out = self.run_check()
        self.assertEqual(rc, 1)
        self.assertIn('not rooted', out)

    def test_router_linking_a_service_transitively_fails(self):
        write(self.root, 'wire/CMakeLists.txt',
              'add_library(pdserve_wire STATIC w.cc)\n'
              'target_link_libraries(pdserve_wire PUBLIC pdserve_decode_service)\n')
        rc, out = self.run_check()
        self.assertEqual(rc, 1)
        self.assertIn('pdserve_router links pdserve_decode_service via '
                      'pdserve_router -> pdserve_wire -> pdserve_decode_service', out)
        # ...and through the service, the engine and its kernels.
        self.assertIn('pdserve_router links pdserve_kernels_cpu', out)

    def test_new_library_link_rules_fail(self):
        cases = [
            # The router may link the KV cache's hashing and events, not the pool.
            ('router/CMakeLists.txt', 'add_library(pdserve_router STATIC r.cc)\n'
             'target_link_libraries(pdserve_router PUBLIC pdserve_kv_cache)\n',
             'pdserve_router links pdserve_kv_cache'),
            ('router/CMakeLists.txt', 'add_library(pdserve_router STATIC r.cc)\n'
             'target_link_libraries(pdserve_router PUBLIC pdserve_model)\n',
             'pdserve_router links pdserve_model'),
            ('tokenizer/CMakeLists.txt', 'add_library(pdserve_tokenizer STATIC t.cc)\n'
             'target_link_libraries(pdserve_tokenizer PUBLIC pdserve_kernels_cpu)\n',
             'pdserve_tokenizer links pdserve_kernels_cpu'),
            ('kv_cache/CMakeLists.txt', 'add_library(pdserve_kv_cache_base STATIC b.cc)\n'
             'add_library(pdserve_kv_cache STATIC c.cc)\n'
             'target_link_libraries(pdserve_kv_cache_base PUBLIC pdserve_kernels_cpu)\n',
             'pdserve_kv_cache_base links pdserve_kernels_cpu'),
            ('kv_cache/CMakeLists.txt', 'add_library(pdserve_kv_cache_base STATIC b.cc)\n'
             'add_library(pdserve_kv_cache STATIC c.cc)\n'
             'target_link_libraries(pdserve_kv_cache PUBLIC pdserve_model)\n',
             'pdserve_kv_cache links pdserve_model'),
            ('model/CMakeLists.txt', 'add_library(pdserve_model STATIC m.cc)\n'
             'target_link_libraries(pdserve_model PUBLIC pdserve_engine)\n',
             'pdserve_model links pdserve_engine'),
            ('structured/CMakeLists.txt', 'add_library(pdserve_structured STATIC s.cc)\n'
             'target_link_libraries(pdserve_structured PUBLIC pdserve_model)\n',
             'pdserve_structured links pdserve_model'),
        ]
        for rel, text, message in cases:
            with self.subTest(rel=rel, message=message):
                write(self.root, rel, text)
                rc, out = self.run_check()
                self.assertEqual(rc, 1, out)
                self.assertIn(message, out)
                write(self.root, rel, self.cmake[rel])


if __name__ == '__main__':
    unittest.main()
