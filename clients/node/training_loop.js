// An on-policy GRPO loop from Node.js, through stubs loaded from this repository's .proto files:
// per step, a group of rollouts per task (AgentService.RunJson under a policy version), one token
// sequence per rollout with its loss mask, GRPO advantages per task, and what an optimizer step
// would receive; then ModelService.SetPolicyVersion on every replica of the model server, as a
// trainer does after pushing new weights to the engine. The same as examples/training_loop.py.
//
//   node training_loop.js REGISTRY_ADDRESS AGENT MODEL_SERVER TASKS.jsonl [GROUP_SIZE] [STEPS] [LIMIT]
//
// Prints one JSON line per step. A failed rollout is a masked member of its group (no loss),
// never a reward-0 sample.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.join(__dirname, '..', '..', 'proto');
const definition = protoLoader.loadSync(
  ['gym/v1/agent_service.proto', 'gym/v1/model_service.proto', 'gym/v1/registry_service.proto'],
  { includeDirs: [PROTO_DIR], keepCase: true, longs: Number, enums: String, defaults: false, oneofs: true },
);
const gym = grpc.loadPackageDefinition(definition).gym.v1;
const DEADLINE_MS = 120000;
const OPTIONS = { 'grpc.max_receive_message_length': 64 * 1024 * 1024 };

function call(client, method, request) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + DEADLINE_MS);
    client[method](request, { deadline }, (error, reply) => (error ? reject(error) : resolve(reply)));
  });
}

// One rollout, or its failure (a masked group member).
async function rollout(agent, row, version) {
  try {
    const reply = await call(agent, 'RunJson', { row_json: JSON.stringify(row), policy_version: version });
    return { row: JSON.parse(reply.rollout_json) };
  } catch (error) {
    return { failure: `${grpc.status[error.code]}: ${error.details}` };
  }
}

// One token sequence: the first prompt, then each generation (mask 1) and what came between (mask 0).
function sample(result) {
  if (result.failure) return { failure: result.failure, reward: null, ids: [], mask: [] };
  const ids = [];
  const mask = [];
  const versions = [];
  let promptLength = null;
  for (const item of result.row.response.output) {
    if (!item.generation_token_ids) continue;
    if (item.policy_version !== undefined) versions.push(item.policy_version);
    const prompt = item.prompt_token_ids || [];
    if (promptLength === null) {
      promptLength = prompt.length;
      ids.push(...prompt);
    } else {
      // A prompt that does not extend the earlier ids would start a new sample (docs/training.md).
      if (prompt.slice(0, ids.length).some((id, i) => id !== ids[i])) throw new Error('non-monotonic history');
      const between = prompt.slice(ids.length);
      ids.push(...between);
      mask.push(...between.map(() => 0));
    }
    ids.push(...item.generation_token_ids);
    mask.push(...item.generation_token_ids.map(() => 1));
  }
  // The oldest turn's policy version: the weights furthest behind that the sample holds.
  return { reward: result.row.reward, ids, mask, promptLength, version: versions.length ? Math.min(...versions) : null };
}

// GRPO: (reward - mean) / std over the group's finished rollouts; 0 for a failed one.
function advantages(samples) {
  const rewards = samples.filter((s) => s.reward !== null).map((s) => s.reward);
  const mean = rewards.reduce((a, b) => a + b, 0) / (rewards.length || 1);
  const std = Math.sqrt(rewards.reduce((a, r) => a + (r - mean) ** 2, 0) / (rewards.length || 1));
  return samples.map((s) => (s.reward === null ? 0 : (s.reward - mean) / (std + 1e-6)));
}

async function main() {
  const [registryAddress, agentName, modelServer, tasksPath, groupArg, stepsArg, limitArg] = process.argv.slice(2);
  if (!tasksPath) {
    console.error('usage: node training_loop.js REGISTRY_ADDRESS AGENT MODEL_SERVER TASKS.jsonl [GROUP_SIZE] [STEPS] [LIMIT]');
    process.exit(2);
  }
  const groupSize = Number(groupArg || 4);
  const steps = Number(stepsArg || 2);
  const tasks = fs.readFileSync(tasksPath, 'utf8').split('\n').filter((l) => l.trim())
    .slice(0, Number(limitArg || 4)).map((l) => JSON.parse(l));
  const insecure = grpc.credentials.createInsecure();
  const registry = new gym.RegistryService(registryAddress, insecure);
  const agentInfo = (await call(registry, 'GetServer', { name: agentName })).server;
  const modelInfo = (await call(registry, 'GetServer', { name: modelServer })).server;
  const agent = new gym.AgentService(agentInfo.addresses.join(','), insecure, OPTIONS);
  // Every replica of the model server learns which weights its engine serves: first the ones it starts from.
  async function weightsUpdated(version) {
    for (const address of modelInfo.addresses) {
      const model = new gym.ModelService(address, insecure);
      await call(model, 'SetPolicyVersion', { version });
      model.close();
    }
  }
  let version = 0;
  await weightsUpdated(version);
  for (let step = 0; step < steps; step += 1) {
    const groups = await Promise.all(tasks.map((task) => Promise.all(
      Array.from({ length: groupSize }, () => rollout(agent, task, version)),
    )));
    const samples = groups.map((group) => group.map(sample));
    const trained = samples.flat().filter((s) => s.reward !== null);
    console.log(JSON.stringify({
      step,
      policy_version: version,
      rollouts: samples.flat().length,
      failed: samples.flat().length - trained.length,
      trained_tokens: trained.reduce((a, s) => a + s.mask.filter((m) => m).length, 0),
      versions_seen: [...new Set(trained.map((s) => s.version))],
      mean_reward: trained.length ? trained.reduce((a, s) => a + s.reward, 0) / trained.length : null,
      advantages: samples.map((group) => advantages(group).map((a) => Math.round(a * 1000) / 1000)),
    }));
    // ... the optimizer step and the weight push to the engine go here ...
    version += 1;
    await weightsUpdated(version);
  }
  agent.close();
  registry.close();
}

main().catch((error) => {
  console.error(error.message || error);
  process.exit(1);
});
