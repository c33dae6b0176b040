// Run one rollout through a gym-grpc agent, then have the agent's resources
// server verify it again, from Node.js. The stubs come from the .proto files
// of this repository (proto/gym/v1), loaded at run time: no JSON by hand.
//
//   node rollout.js REGISTRY_ADDRESS AGENT_NAME "PROMPT" EXPECTED_ANSWER
//
// Before the rollout it shakes hands (AdminService.GetServerInfo): it refuses
// an agent that speaks another major version of the protocol, and accepts
// replies as large as the agent may send (grpc-js accepts 4 MiB by default).
//
// Prints one JSON line: the agent, the protocol version it speaks, the reward
// of the rollout, the reward of the second verification, the stop reason and
// the token counts.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.join(__dirname, '..', '..', 'proto');
const definition = protoLoader.loadSync(
  [
    'gym/v1/admin_service.proto',
    'gym/v1/agent_service.proto',
    'gym/v1/registry_service.proto',
    'gym/v1/resources_service.proto',
  ],
  { includeDirs: [PROTO_DIR], keepCase: true, longs: Number, enums: String, defaults: false, oneofs: true },
);
const gym = grpc.loadPackageDefinition(definition).gym.v1;
const DEADLINE_MS = 30000;
// The major version of the gym protocol this client was written for.
const PROTOCOL_MAJOR = 1;

// Promisify one unary call of a generated client.
function call(client, method, request) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + DEADLINE_MS);
    client[method](request, { deadline }, (error, reply) => (error ? reject(error) : resolve(reply)));
  });
}

async function server(registry, name) {
  const reply = await call(registry, 'GetServer', { name });
  return reply.server;
}

// The handshake: what the server at `address` is; throws when its protocol major version is not ours.
async function shakeHands(address, credentials) {
  const admin = new gym.AdminService(address, credentials);
  try {
    const info = await call(admin, 'GetServerInfo', {});
    const protocol = info.protocol || {};
    const major = protocol.major || 1; // unset: a server from before the handshake, which speaks 1.0
    if (major !== PROTOCOL_MAJOR) {
      throw new Error(`${info.name} at ${address} speaks gym protocol ${major}.${protocol.minor || 0}; `
        + `this client speaks ${PROTOCOL_MAJOR}.x`);
    }
    return info;
  } finally {
    admin.close();
  }
}

async function main() {
  const [registryAddress, agentName, prompt, expectedAnswer] = process.argv.slice(2);
  if (!expectedAnswer) {
    console.error('usage: node rollout.js REGISTRY_ADDRESS AGENT_NAME PROMPT EXPECTED_ANSWER');
    process.exit(2);
  }
  const insecure = grpc.credentials.createInsecure();
  const registry = new gym.RegistryService(registryAddress, insecure);
  const agentInfo = await server(registry, agentName);
  const resourcesInfo = await server(registry, agentInfo.references.resources);

  // Field names are the .proto's (keepCase); the task's own fields are JSON text.
  const task = {
    responses_create_params: { input_text: prompt, temperature: 0 },
    data_json: JSON.stringify({ expected_answer: expectedAnswer }),
  };
  const handshake = await shakeHands(agentInfo.addresses[0], insecure);
  const agent = new gym.AgentService(agentInfo.addresses[0], insecure, {
    'grpc.max_receive_message_length': handshake.capabilities.max_send_message_bytes,
  });
  const { rollout } = await call(agent, 'Run', { task });

  const resources = new gym.ResourcesService(resourcesInfo.addresses[0], insecure);
  const verdict = await call(resources, 'Verify', {
    session_id: `node-${Date.now()}`,
    task,
    response: rollout.response,
  });

  const withIds = rollout.response.output.filter((item) => {
    const inner = item[item.item];
    return inner && inner.generation_token_ids && inner.generation_token_ids.length > 0;
  });
  console.log(JSON.stringify({
    agent: agentName,
    protocol: `${handshake.protocol.major}.${handshake.protocol.minor || 0}`,
    reward: rollout.reward || 0,
    reverified_reward: verdict.reward || 0,
    stop_reason: rollout.stop_reason,
    output_items: rollout.response.output.length,
    turns_with_token_ids: withIds.length,
  }));
  for (const client of [registry, agent, resources]) client.close();
}

main().catch((error) => {
  console.error(`rollout failed: ${error.code === undefined ? '' : grpc.status[error.code] + ': '}${error.details || error.message}`);
  process.exit(1);
});
