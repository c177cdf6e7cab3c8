#!/usr/bin/env node
// Validates Kubernetes objects (multi-document YAML files) offline, two ways:
//  1. the JSON schemas of kubernetes-models (types, required fields, formats, enums);
//  2. a strict TypeScript check: every object becomes an object literal typed with its
//     kubernetes-models interface, so TypeScript's excess-property check rejects any field the API
//     does not know (the schemas alone accept unknown fields, and the API server drops them
//     silently — a misspelt "livenessprobe" would just vanish).
//
//   node validate_schemas.cjs FILE.yaml...        exit 0 when every object passes, else 1
//   node validate_schemas.cjs --self-test DIR     DIR/reject/*.yaml must each be rejected with the
//                                                 text of their "# expect: ..." lines; DIR/accept/*
//                                                 must pass. Proves the check can fail.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const YAML = require('yaml');
const ts = require('typescript');

const kModelsDir = path.join(__dirname, 'node_modules', 'kubernetes-models');

// "apps/v1" + "Deployment" -> "apps/v1/Deployment"; core "v1" -> "v1/Service".
function modelPath(apiVersion, kind) {
  return `${apiVersion}/${kind}`;
}

function hasModel(apiVersion, kind) {
  return typeof apiVersion === 'string' && typeof kind === 'string' &&
         /^[A-Za-z0-9.\-/]+$/.test(apiVersion) && /^[A-Za-z0-9]+$/.test(kind) &&
         fs.existsSync(path.join(kModelsDir, modelPath(apiVersion, kind) + '.d.ts'));
}

function describe(obj) {
  const name = obj && obj.metadata && obj.metadata.name;
  return `${obj && obj.kind}/${name}`;
}

// Reads every YAML document of a file as {file, index, obj}.
function loadObjects(file) {
  const text = fs.readFileSync(file, 'utf8');
  const out = [];
  YAML.parseAllDocuments(text).forEach((doc, index) => {
    if (doc.errors.length) {
      throw new Error(`${file}: YAML error: ${doc.errors[0].message}`);
    }
    const obj = doc.toJS();
    if (obj !== null && obj !== undefined) out.push({file, index, obj});
  });
  return out;
}

// Schema validation with the model's own validator.
function schemaProblems(item) {
  const {obj} = item;
  if (!hasModel(obj.apiVersion, obj.kind)) {
    return [`no Kubernetes schema for apiVersion=${obj.apiVersion} kind=${obj.kind}`];
  }
  const mod = require(path.join(kModelsDir, modelPath(obj.apiVersion, obj.kind)));
  const Model = mod[obj.kind];
  try {
    new Model(obj).validate();
    return [];
  } catch (err) {
    if (err && Array.isArray(err.errors)) {
      return err.errors.map(
          (e) => `schema: ${e.instancePath || '/'} ${e.message}` +
              (e.params && e.params.allowedValues ? ` ${JSON.stringify(e.params.allowedValues)}` :
                                                    ''));
    }
    return [`schema: ${err && err.message ? err.message : String(err)}`];
  }
}

// Writes `value` as a TypeScript literal into `lines`, recording for each line the JSON path it
// belongs to, so a diagnostic can name the offending field.
function emitLiteral(value, indent, pathStr, lines, paths, prefix, suffix) {
  const pad = '  '.repeat(indent);
  if (Array.isArray(value)) {
    if (value.length === 0) {
      lines.push(`${pad}${prefix}[]${suffix}`);
      paths.push(pathStr);
      return;
    }
    lines.push(`${pad}${prefix}[`);
    paths.push(pathStr);
    value.forEach((v, i) => emitLiteral(v, indent + 1, `${pathStr}[${i}]`, lines, paths, '', ','));
    lines.push(`${pad}]${suffix}`);
    paths.push(pathStr);
  } else if (value !== null && typeof value === 'object') {
    const keys = Object.keys(value);
    if (keys.length === 0) {
      lines.push(`${pad}${prefix}{}${suffix}`);
      paths.push(pathStr);
      return;
    }
    lines.push(`${pad}${prefix}{`);
    paths.push(pathStr);
    for (const k of keys) {
      emitLiteral(value[k], indent + 1, `${pathStr}.${k}`, lines, paths, `${JSON.stringify(k)}: `,
                  ',');
    }
    lines.push(`${pad}}${suffix}`);
    paths.push(pathStr);
  } else {
    lines.push(`${pad}${prefix}${JSON.stringify(value)}${suffix}`);
    paths.push(pathStr);
  }
}

// Strict check of many objects in one TypeScript program (one compile is ~2 s; per object would
// be far slower). Returns Map(item -> [problems]).
function strictProblems(items) {
  const result = new Map(items.map((it) => [it, []]));
  const typed = items.filter((it) => hasModel(it.obj.apiVersion, it.obj.kind));
  if (!typed.length) return result;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'hsdp-k8s-strict-'));
  try {
    const lines = [];
    const owners = [];  // per line: [item, json path]
    typed.forEach((it, n) => {
      const {apiVersion, kind} = it.obj;
      lines.push(`import type { I${kind} as T${n} } from "kubernetes-models/${apiVersion}/${kind}";`);
      owners.push([it, '']);
    });
    typed.forEach((it, n) => {
      const paths = [];
      const before = lines.length;
      emitLiteral(it.obj, 0, '', lines, paths, `export const o${n}: T${n} = `, ';');
      for (let i = before; i < lines.length; i++) owners.push([it, paths[i - before] || '.']);
    });
    const file = path.join(dir, 'objects.ts');
    fs.writeFileSync(file, lines.join('\n') + '\n');
    const program = ts.createProgram([file], {
      strict: true,
      noEmit: true,
      skipLibCheck: true,
      types: [],
      target: ts.ScriptTarget.ES2020,
      module: ts.ModuleKind.CommonJS,
      moduleResolution: ts.ModuleResolutionKind.Node10,
      baseUrl: __dirname,
      paths: {'kubernetes-models/*': ['node_modules/kubernetes-models/*']},
    });
    const diags = ts.getPreEmitDiagnostics(program);
    for (const d of diags) {
      const msg = ts.flattenDiagnosticMessageText(d.messageText, ' ');
      if (!d.file || path.resolve(d.file.fileName) !== path.resolve(file)) {
        // A problem outside our generated file (e.g. in the installed typings) is a broken
        // toolchain, not a manifest error: fail loudly, attributed to every object.
        for (const it of typed) result.get(it).push(`typescript: ${msg}`);
        continue;
      }
      const {line} = d.file.getLineAndCharacterOfPosition(d.start || 0);
      const [it, jsonPath] = owners[line] || [typed[0], '?'];
      result.get(it).push(`unknown or mistyped field at ${jsonPath || '.'}: ${msg}`);
    }
  } finally {
    fs.rmSync(dir, {recursive: true, force: true});
  }
  return result;
}

// All problems per item.
function validate(items) {
  const strict = strictProblems(items);
  return items.map((it) => ({item: it, problems: [...schemaProblems(it), ...strict.get(it)]}));
}

function report(results) {
  let bad = 0;
  for (const {item, problems} of results) {
    for (const p of problems) {
      console.log(`${item.file} [doc ${item.index}] ${describe(item.obj)}: ${p}`);
      bad++;
    }
  }
  return bad;
}

function selfTest(dir) {
  const listYaml = (sub) => {
    const d = path.join(dir, sub);
    return fs.existsSync(d) ?
        fs.readdirSync(d).filter((f) => /\.ya?ml$/.test(f)).sort().map((f) => path.join(d, f)) :
        [];
  };
  const rejects = listYaml('reject');
  const accepts = listYaml('accept');
  if (!rejects.length) throw new Error(`no fixtures in ${dir}/reject`);
  const items = [...rejects, ...accepts].flatMap(loadObjects);
  const results = validate(items);
  let failures = 0;
  for (const file of rejects) {
    const expects = fs.readFileSync(file, 'utf8').split('\n')
                        .map((l) => /^# expect: (.*)$/.exec(l))
                        .filter(Boolean)
                        .map((m) => m[1]);
    if (!expects.length) throw new Error(`${file}: no "# expect: ..." line`);
    const problems = results.filter((r) => r.item.file === file).flatMap((r) => r.problems);
    for (const e of expects) {
      if (problems.some((p) => p.includes(e))) {
        console.log(`ok   ${path.basename(file)}: rejected with "${e}"`);
      } else {
        console.log(`FAIL ${path.basename(file)}: expected a problem containing "${e}", got: ` +
                    (problems.length ? problems.join(' | ') : 'none (accepted)'));
        failures++;
      }
    }
  }
  for (const file of accepts) {
    const problems = results.filter((r) => r.item.file === file).flatMap((r) => r.problems);
    if (problems.length) {
      console.log(`FAIL ${path.basename(file)}: expected to pass, got: ${problems.join(' | ')}`);
      failures++;
    } else {
      console.log(`ok   ${path.basename(file)}: accepted`);
    }
  }
  return failures;
}

function main(argv) {
  if (argv[0] === '--self-test') {
    const failures = selfTest(argv[1]);
    console.log(failures ? `self-test: ${failures} failure(s)` : 'self-test: all fixtures behaved');
    return failures ? 1 : 0;
  }
  if (!argv.length) {
    console.error('usage: validate_schemas.cjs FILE.yaml... | --self-test DIR');
    return 2;
  }
  const items = argv.flatMap(loadObjects);
  if (!items.length) {
    console.log('no objects found');
    return 1;
  }
  const bad = report(validate(items));
  const kinds = [...new Set(items.map((it) => it.obj.kind))].sort().join(', ');
  console.log(bad ? `${bad} problem(s) in ${items.length} objects` :
                    `${items.length} objects valid and free of unknown fields (${kinds})`);
  return bad ? 1 : 0;
}

try {
  process.exitCode = main(process.argv.slice(2));
} catch (err) {
  console.error(`validate_schemas: ${err.message}`);
  process.exitCode = 1;
}
